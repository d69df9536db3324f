"""Helpers the benches share (not run on their own, except merge.py and the VRAM holder)."""
