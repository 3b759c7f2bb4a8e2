"""Hugging Face <-> Megatron checkpoint conversion (see docs/conversion.md)."""
