"""`load_video` on clips written here with PyAV: the accepted forms (paths, bytes, HF and verl dicts,
frame lists), qwen-vl-utils-style frame sampling, pixel bounds, and the errors for bad videos.

Frame ``i`` of every test clip is a solid colour whose red channel is ``12 * i``, so a decoded
frame's source index can be read back from its pixels (exactly for the lossless clips, to within
a few levels for mpeg4)."""

import importlib.util
import io
import sys
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from rlhf_megatron.data import video as video_module
from rlhf_megatron.data.multimodal import target_size
from rlhf_megatron.data.video import (
    FRAME_FACTOR,
    VIDEO_PLACEHOLDER,
    Video,
    VideoError,
    load_video,
    video_list,
)

W, H = 64, 48


def colour_frame(i: int, width: int = W, height: int = H) -> np.ndarray:
    frame = np.empty((height, width, 3), np.uint8)
    frame[...] = (12 * i % 256, 255 - 12 * i % 256, 100)
    return frame


def frame_ids(video: Video) -> list[int]:
    """The source index of each frame of a clip written by `write_clip` (from its red channel)."""
    return [round(float(f[..., 0].mean()) / 12) for f in video.frames]


def write_clip(path, n=20, rate=10, codec="mpeg4", pix_fmt="yuv420p", width=W, height=H) -> str:
    """A clip of ``n`` solid-colour frames (`colour_frame`) at ``rate`` fps."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, pix_fmt
        for i in range(n):
            frame = av.VideoFrame.from_ndarray(colour_frame(i, width, height), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return str(path)


def png_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def expected_indices(total: int, n: int) -> list[int]:
    return np.linspace(0, total - 1, n).round().astype(int).tolist()


@pytest.fixture
def mp4(tmp_path):
    """20 frames at 10 fps, 64x48, mpeg4 in mp4 (the container states its frame count)."""
    return write_clip(tmp_path / "clip.mp4")


# ---------------------------------------------------------------------------------------------- video_list


def test_constants():
    assert VIDEO_PLACEHOLDER == "<video>" and FRAME_FACTOR == 2
    assert issubclass(VideoError, ValueError)


def test_video_list_cases():
    assert video_list(None) == []
    assert video_list("a.mp4") == ["a.mp4"]
    assert video_list(b"\x00\x01") == [b"\x00\x01"]
    assert video_list({"bytes": b"x", "path": None}) == [{"bytes": b"x", "path": None}]
    assert video_list(["a.mp4", "b.mp4"]) == ["a.mp4", "b.mp4"]
    assert video_list(("a.mp4",)) == ["a.mp4"]
    frames = [b"f0", b"f1"]
    assert video_list([frames]) == [frames]  # one video given as its frames
    cell = np.empty(2, dtype=object)  # how pandas hands a parquet list cell over
    cell[0], cell[1] = {"path": "a.mp4"}, {"path": "b.mp4"}
    assert video_list(cell) == [{"path": "a.mp4"}, {"path": "b.mp4"}]
    array = np.zeros((2, 4, 4, 3), np.uint8)  # a uint8 array is one video, not a list of videos
    out = video_list(array)
    assert len(out) == 1 and out[0] is array
    assert video_list([]) == []


# ---------------------------------------------------------------------------------------------- sampling


def test_path_samples_at_target_fps(mp4):
    video = load_video(mp4, fps=2.0)
    assert isinstance(video, Video)
    assert video.frames.shape == (4, H, W, 3) and video.frames.dtype == np.uint8
    assert frame_ids(video) == expected_indices(20, 4) == [0, 6, 13, 19]
    assert video.fps == pytest.approx(2.0)
    assert video.second_per_grid == pytest.approx(1.0)
    assert video.source_frames == 20


def test_lossless_frames_are_exact(tmp_path):
    path = write_clip(tmp_path / "clip.mov", codec="png", pix_fmt="rgb24")
    video = load_video(path, fps=4.0)  # 2 s x 4 fps = 8 frames
    indices = expected_indices(20, 8)
    assert video.frames.shape == (8, H, W, 3)
    for frame, i in zip(video.frames, indices):
        np.testing.assert_array_equal(frame, colour_frame(i))


def test_container_without_frame_count_is_counted_first(tmp_path):
    path = write_clip(tmp_path / "clip.mkv", codec="ffv1", pix_fmt="bgr0")
    with av.open(path) as container:
        assert not container.streams.video[0].frames  # mkv states no count: the counting pass runs
    video = load_video(path, fps=2.0)
    assert video.source_frames == 20 and video.fps == pytest.approx(2.0)
    for frame, i in zip(video.frames, [0, 6, 13, 19]):
        np.testing.assert_array_equal(frame, colour_frame(i))


def test_stated_frame_count_saves_the_counting_pass(tmp_path, monkeypatch):
    mp4 = write_clip(tmp_path / "clip.mp4")
    mkv = write_clip(tmp_path / "clip.mkv", codec="ffv1", pix_fmt="bgr0")
    opened = []
    real_open = av.open

    def counting_open(*args, **kwargs):
        opened.append(args[0])
        return real_open(*args, **kwargs)

    monkeypatch.setattr(av, "open", counting_open)
    assert frame_ids(load_video(mp4)) == [0, 6, 13, 19]
    assert len(opened) == 1  # mp4 states 20 frames: decoded once
    assert frame_ids(load_video(mkv)) == [0, 6, 13, 19]
    assert len(opened) == 3  # mkv does not: a counting pass, then a picking pass


def test_frame_count_rounds_half_up_to_frame_factor(mp4):
    assert len(load_video(mp4, fps=2.5).frames) == 6  # 5 frames -> 6
    assert len(load_video(mp4, fps=2.2).frames) == 4  # 4.4 frames -> 4
    video = load_video(mp4, fps=3.0)  # 6 frames exactly
    assert frame_ids(video) == expected_indices(20, 6)
    assert video.fps == pytest.approx(3.0) and video.second_per_grid == pytest.approx(2 / 3)


def test_min_frames_clamp(mp4):
    video = load_video(mp4, fps=0.5)  # 1 frame wanted, min_frames=4
    assert frame_ids(video) == expected_indices(20, 4)
    assert video.fps == pytest.approx(2.0)  # 4 frames over 2 s
    assert len(load_video(mp4, fps=0.5, min_frames=5).frames) == 6  # min rounded up to the factor
    assert len(load_video(mp4, fps=0.5, min_frames=0).frames) == FRAME_FACTOR  # never fewer than 2


def test_max_frames_clamp(mp4):
    video = load_video(mp4, fps=10.0, max_frames=7)  # 20 wanted, max rounded down to 6
    assert frame_ids(video) == expected_indices(20, 6)
    assert video.fps == pytest.approx(3.0)
    video = load_video(mp4, fps=30.0)  # 60 wanted but the source has 20
    assert frame_ids(video) == list(range(20))
    assert video.fps == pytest.approx(10.0)


def test_short_clips_never_gain_frames(tmp_path):
    three = load_video(write_clip(tmp_path / "three.mp4", n=3), fps=2.0)  # min_frames=4 > 3 frames
    assert frame_ids(three) == [0, 2] and three.source_frames == 3
    assert three.fps == pytest.approx(2 / 3 * 10)
    one = load_video(write_clip(tmp_path / "one.mp4", n=1), fps=2.0)
    assert one.frames.shape == (2, H, W, 3) and frame_ids(one) == [0, 0]
    assert one.source_frames == 1 and one.fps == pytest.approx(20.0)


def test_nframes(mp4):
    video = load_video({"video": mp4, "nframes": np.int64(8)})  # numbers as pandas hands them over
    assert frame_ids(video) == expected_indices(20, 8)
    assert video.fps == pytest.approx(4.0)  # 8 of 20 frames at 10 fps
    assert len(load_video({"video": mp4, "nframes": 7}).frames) == 8  # rounded half up
    assert len(load_video({"video": mp4, "nframes": 12, "max_frames": 6}).frames) == 6
    assert len(load_video({"video": mp4, "nframes": 19}).frames) == 20  # 19 -> 20, all of them
    with pytest.raises(VideoError, match=r"nframes=30.*only 20 frames"):
        load_video({"video": mp4, "nframes": 30})
    with pytest.raises(VideoError, match="nframes must be at least 1"):
        load_video({"video": mp4, "nframes": 0})


# ---------------------------------------------------------------------------------------------- forms


def test_relative_paths_and_file_prefix(tmp_path, monkeypatch):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    write_clip(data_dir / "clip.mp4", n=6)
    assert load_video("clip.mp4", base_dir=str(data_dir)).source_frames == 6
    assert load_video(Path(data_dir / "clip.mp4")).source_frames == 6  # os.PathLike
    assert load_video("file://" + str(data_dir / "clip.mp4")).source_frames == 6
    monkeypatch.chdir(data_dir)  # not in base_dir: the current directory is the fallback
    assert load_video("clip.mp4", base_dir=str(tmp_path)).source_frames == 6


def test_bytes_and_hf_dicts(mp4):
    data = Path(mp4).read_bytes()
    reference = frame_ids(load_video(mp4))
    for value in (data, bytearray(data), {"bytes": data}, {"bytes": data, "path": "ignored.mp4"}):
        video = load_video(value)
        assert frame_ids(video) == reference and video.source_frames == 20
    assert frame_ids(load_video({"path": mp4})) == reference
    assert frame_ids(load_video({"bytes": None, "path": mp4})) == reference


def test_verl_dict_overrides_arguments(mp4):
    video = load_video({"type": "video", "video": mp4, "fps": np.float32(5.0)}, fps=2.0)
    assert frame_ids(video) == expected_indices(20, 10) and video.fps == pytest.approx(5.0)
    video = load_video({"video": "file://" + mp4, "max_frames": 6, "unknown": 1}, fps=10.0)
    assert len(video.frames) == 6
    video = load_video({"video": mp4, "max_pixels": 1000}, max_pixels=None)
    assert video.frames.shape[1] * video.frames.shape[2] <= 1000
    with pytest.raises(VideoError, match="type 'image' is not a video"):
        load_video({"type": "image", "video": mp4})
    with pytest.raises(VideoError, match="needs 'video', 'bytes' or 'path'"):
        load_video({"fps": 2.0})


def test_frame_lists_of_every_kind(tmp_path):
    arrays = [colour_frame(i) for i in range(4)]
    (tmp_path / "f3.png").write_bytes(png_bytes(arrays[3]))
    forms = [
        Image.fromarray(arrays[0]),
        png_bytes(arrays[1]),
        {"bytes": png_bytes(arrays[2]), "path": None},
        {"path": "f3.png"},  # relative to base_dir
    ]
    video = load_video(forms, fps=3.0, base_dir=str(tmp_path))
    assert video.frames.shape == (4, H, W, 3) and video.fps == 3.0 and video.source_frames == 4
    for frame, array in zip(video.frames, arrays):
        np.testing.assert_array_equal(frame, array)
    assert frame_ids(load_video(arrays)) == [0, 1, 2, 3]  # no temporal resampling
    assert frame_ids(load_video(np.stack(arrays))) == [0, 1, 2, 3]  # a [T, H, W, 3] array
    cell = np.empty(2, dtype=object)
    cell[0], cell[1] = arrays[0], arrays[1]
    assert frame_ids(load_video(cell)) == [0, 1]


def test_verl_frame_list_and_odd_length_padding():
    arrays = [colour_frame(i) for i in range(5)]
    video = load_video({"video": arrays, "fps": 4.0}, fps=2.0)
    assert frame_ids(video) == [0, 1, 2, 3, 4, 4]  # the last frame repeated to a multiple of 2
    assert video.source_frames == 5 and video.fps == 4.0 and video.second_per_grid == 0.5
    single = load_video([Image.fromarray(arrays[2])])
    assert frame_ids(single) == [2, 2] and single.fps == 2.0


def test_pixel_bounds(mp4):
    small = load_video(mp4, max_pixels=1000)
    t, h, w, _ = small.frames.shape
    assert (w, h) == target_size(W, H, None, 1000) and w * h <= 1000 and t == 4
    # Resizing a solid frame keeps its colour: the frames are still the sampled ones.
    assert frame_ids(small) == [0, 6, 13, 19]
    big = load_video(mp4, min_pixels=W * H * 4)
    assert big.frames.shape[1:] == (2 * H, 2 * W, 3)
    frames = load_video([colour_frame(0), colour_frame(1)], max_pixels=1000).frames
    assert frames.shape[1] * frames.shape[2] <= 1000 and frames.dtype == np.uint8
    unchanged = load_video(mp4, min_pixels=W * H, max_pixels=W * H)
    assert unchanged.frames.shape[1:] == (H, W, 3)


# ---------------------------------------------------------------------------------------------- errors


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(VideoError, match="does not exist") as err:
        load_video("nope.mp4", base_dir=str(tmp_path))
    assert "'nope.mp4'" in str(err.value) and str(tmp_path / "nope.mp4") in str(err.value)
    with pytest.raises(VideoError, match="does not exist"):
        load_video({"video": str(tmp_path / "gone.mp4")})
    with pytest.raises(VideoError, match="is a URL"):
        load_video("https://example.com/a.mp4")


def test_corrupt_and_truncated_files(tmp_path, mp4):
    corrupt = tmp_path / "x.mp4"
    corrupt.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(VideoError, match="cannot be decoded") as err:
        load_video(str(corrupt))
    assert str(corrupt) in str(err.value) and "Error" in str(err.value)
    truncated = tmp_path / "truncated.mp4"
    truncated.write_bytes(Path(mp4).read_bytes()[:300])
    with pytest.raises(VideoError, match="cannot be decoded") as err:
        load_video(str(truncated))
    assert str(truncated) in str(err.value)
    with pytest.raises(VideoError, match=r"^4096 bytes of video cannot be decoded"):
        load_video(corrupt.read_bytes())
    with pytest.raises(VideoError, match="bytes are empty"):
        load_video(b"")


def test_files_without_video_frames(tmp_path):
    wav = str(tmp_path / "sound.wav")
    with av.open(wav, "w") as container:
        stream = container.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        for packet in [*stream.encode(frame), *stream.encode()]:
            container.mux(packet)
    with pytest.raises(VideoError, match=r"has no video stream \(its streams: audio\)"):
        load_video(wav)

    # A video stream that holds no frames (only audio packets were muxed).
    empty = str(tmp_path / "empty.mkv")
    with av.open(empty, "w") as container:
        video = container.add_stream("mpeg4", rate=10)
        video.width, video.height, video.pix_fmt = W, H, "yuv420p"
        audio = container.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        for packet in [*audio.encode(frame), *audio.encode()]:
            container.mux(packet)
    with pytest.raises(VideoError, match="decodes to 0 frames") as err:
        load_video(empty)
    assert empty in str(err.value)


def test_frame_list_errors(tmp_path):
    mixed = [colour_frame(0), colour_frame(1), colour_frame(2, width=32, height=32)]
    with pytest.raises(VideoError, match=r"frame 2 .* is 32x32 but frame 0 is 64x48"):
        load_video(mixed)
    with pytest.raises(VideoError, match=r"video of 5 frames has more than max_frames=4") as err:
        load_video([colour_frame(i) for i in range(5)], max_frames=4)
    assert "data.video_max_frames" in str(err.value)
    with pytest.raises(VideoError, match="frame 1 .*uint8"):
        load_video([colour_frame(0), colour_frame(1).astype(np.float32)])
    with pytest.raises(VideoError, match=r"frame 0 of a video of 1 frames: .*not a readable image"):
        load_video([b"not a png"])
    with pytest.raises(VideoError, match=r"frame 0 .*does not exist"):
        load_video([{"path": "missing.png"}], base_dir=str(tmp_path))
    with pytest.raises(VideoError, match="frame list is empty"):
        load_video([])


def test_bad_settings(mp4):
    for fps in (0, -1.0, float("nan")):
        with pytest.raises(VideoError, match="data.video_fps"):
            load_video(mp4, fps=fps)
    with pytest.raises(VideoError, match="positive number, got 0"):
        load_video({"video": mp4, "fps": 0})
    with pytest.raises(VideoError, match="fps must be a positive"):
        load_video([colour_frame(0)], fps=0)
    with pytest.raises(VideoError, match=r"max_frames=1 .*data.video_max_frames"):
        load_video(mp4, max_frames=1)
    with pytest.raises(VideoError, match="must be a path, bytes"):
        load_video(42)


def test_frames_need_no_pyav(monkeypatch):
    """The module imports without PyAV and frame lists decode without it; files then need it."""
    monkeypatch.setitem(sys.modules, "av", None)  # `import av` now raises ImportError
    spec = importlib.util.spec_from_file_location("video_without_av", video_module.__file__)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "video_without_av", module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    video = module.load_video([colour_frame(0), colour_frame(1)])
    assert video.frames.shape == (2, H, W, 3)
    with pytest.raises(ImportError, match="PyAV"):
        module.load_video(video_module.__file__)  # an existing file: decoding it needs av
