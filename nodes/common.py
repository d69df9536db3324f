"""Helpers shared by the pack's nodes."""
CATEGORY = "quantization/int8"
# The pack's own ComfyUI types flowing between nodes.
CALIBRATION_TYPE = "INT8_CALIBRATION"
