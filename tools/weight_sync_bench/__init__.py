"""The weight-sync benchmark's library (``tools/bench_weight_sync.py`` is its driver):
``checkpoints`` (random Llama and Qwen3-MoE checkpoints and their sizes), ``engines`` (a rank's
actor, vLLM engine and syncer) and ``measuring`` (one sync timed by phase, its peak memory, the
memcpy floor).

Imported with ``tools/`` on ``sys.path`` (tools/ is not a package); nothing here is imported by
``rlhf_megatron``.
"""
