"""Interpreter-start hook (a ``.pth`` line written by ``scripts/setup_env.sh``). Import-light.

``install()`` adds an import hook that runs
``rlhf_megatron.platform.torchvision_compat.define_torchvision_ops()`` just before the
first ``import torchvision`` of a process; see that module for why. It must not import
torch or anything heavy itself: it runs in every Python process of the environment.
"""

from __future__ import annotations

import sys


class _TorchvisionFirst:
    """A meta-path finder that only watches for torchvision and never finds anything itself."""

    done = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torchvision" or _TorchvisionFirst.done:
            return None
        _TorchvisionFirst.done = True
        try:
            from rlhf_megatron.platform.torchvision_compat import define_torchvision_ops

            define_torchvision_ops()
        except Exception as e:  # never break an import because the compat patch failed
            print(f"rlhf_megatron: torchvision compat patch failed: {e!r}", file=sys.stderr)
        return None  # the normal finders import torchvision itself


def install() -> None:
    if not any(isinstance(f, _TorchvisionFirst) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchvisionFirst())
