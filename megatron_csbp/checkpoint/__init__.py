"""Checkpoints into models and back, for the trainer, `convert`, `score`, `generate`, `dflash` and
the export: `files` (what a `--load` folder holds: Megatron-LM's layout, the trainer's and
converted ones; the one reader and its refusals), `state` (the trainer's atomic torch_dist save and
resume with optimizer and scheduler), `model` (a checkpoint's model built and loaded under any
parallel layout, a release checkpoint saved), `drafter` (the DFlash drafter's file)."""
