"""``python -m rlhf_megatron.launch NAME ...``: the same as ``rlhf-megatron launch NAME ...``."""

import sys

from rlhf_megatron.launch import main

sys.exit(main())
