"""Command-line tools that live inside the package, so ``rlhf-megatron <subcommand>`` can reach them."""
