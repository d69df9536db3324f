"""Helpers the benches share (not run on their own, except the merge scripts and the VRAM holder)."""
