"""dualkv.train: GRPO/DAPO losses, the policy update, FSDP2 x sequence-parallel training."""
