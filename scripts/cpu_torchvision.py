"""Lets PyPI's torchvision import beside the CPU build of torch in the test runtime.

PyPI's x86_64 torchvision is a CUDA build: its compiled ops (``_C.so``) link CUDA torch, so beside a CPU torch
they do not load. torchvision tolerates that (``torchvision.extension._has_ops()`` is then False and its ops
raise "Couldn't load custom C++ ops"), except that its import registers fake kernels for two operators,
``torchvision::nms`` and ``torchvision::qnms``, without checking, and that fails when the operators do not
exist. This module defines those two schemas (no kernels: calling them still fails) just before torchvision is
first imported. scripts/setup_runtime.sh copies it into the CPU runtime's site-packages with a ``.pth`` line
that imports it; it is never part of the pack.
"""
import importlib.abc
import sys

_SCHEMAS = ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
            "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_libs = []  # a torch.library.Library unregisters its operators when collected


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            import torch
            lib = torch.library.Library("torchvision", "FRAGMENT")
            for schema in _SCHEMAS:
                lib.define(schema)
            _libs.append(lib)
        return None  # the normal import goes on


sys.meta_path.insert(0, _BeforeTorchvision())
