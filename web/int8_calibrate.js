// Shows the per-layer summary of "INT8 Calibrate" / "Load INT8 Calibration" and the path written by
// "Save INT8 Calibration" / "Save INT8 Model" on the node itself: the nodes return {"ui": {"text": [summary]}}, which the
// frontend does not display on its own (core does the same for PreviewAny with a read-only widget).
import { app } from "../../scripts/app.js";
import { ComfyWidgets } from "../../scripts/widgets.js";

const NODE_TYPES = new Set(["Int8Calibrate", "LoadInt8Calibration", "SaveInt8Calibration", "SaveInt8Model"]);
const WIDGET = "int8_calibration_summary";

function summaryWidget(node) {
  let w = node.widgets?.find((x) => x.name === WIDGET);
  if (!w) {
    w = ComfyWidgets.STRING(node, WIDGET, ["STRING", { multiline: true }], app).widget;
    // display only: kept out of the saved workflow (serialize) and of the prompt (options.serialize),
    // so the summary never changes the node's inputs and never invalidates ComfyUI's cache
    w.serialize = false;
    w.options ??= {};
    w.options.serialize = false;
    w.options.read_only = true;
    if (w.inputEl) {
      w.inputEl.readOnly = true;
      w.inputEl.style.fontFamily = "monospace";
      w.inputEl.style.fontSize = "10px";
      w.inputEl.style.whiteSpace = "pre";
    }
  }
  return w;
}

app.registerExtension({
  name: "int8_fused.calibration_summary",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!NODE_TYPES.has(nodeData?.name)) return;
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      onExecuted?.apply(this, arguments);
      const text = message?.text;
      if (!text?.length) return;
      summaryWidget(this).value = Array.isArray(text) ? text.join("\n") : String(text);
      this.setDirtyCanvas?.(true, true);
    };
  },
});
