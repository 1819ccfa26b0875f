"""SGLang 0.5.23 on CPU for the HiCache conformance: its modules need Triton (installed by setup.sh) and
torchvision at import (stood in for: only its vision models use it), and a real ``MHATokenToKVPoolHost``
built over plain CPU tensors standing for the device pool."""

from __future__ import annotations

import importlib.machinery
import sys

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "benchmarks" / "peers"))
import stubs  # noqa: E402


class _VersionedStub(stubs._Finder):
    def exec_module(self, module) -> None:  # noqa: ANN001
        module.__version__ = "0.0"  # transformers parses it and then treats torchvision as too old


if importlib.machinery.PathFinder.find_spec("torchvision") is None:
    sys.meta_path.insert(0, _VersionedStub({"torchvision"}))

import torch  # noqa: E402
from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402

LAYERS, HEADS, HEAD_DIM, PAGE = 4, 2, 64, 16


def host_pool(tokens: int = 4096, layout: str = "page_first", dtype=torch.float16) -> MHATokenToKVPoolHost:
    """SGLang's MHA host pool (``tokens`` device slots, host ratio 2) on the CPU."""
    k = [torch.zeros(tokens + PAGE, HEADS, HEAD_DIM, dtype=dtype) for _ in range(LAYERS)]
    v = [torch.zeros(tokens + PAGE, HEADS, HEAD_DIM, dtype=dtype) for _ in range(LAYERS)]

    def ptrs(bufs):
        return torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)

    info = MHABufferInfo(buffers=KVBuffers(k=tuple(k), v=tuple(v), k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v),
                                           layout=KVBufferLayout.NHD),
                         page_size=PAGE, head_num=HEADS, head_dim=HEAD_DIM, v_head_dim=HEAD_DIM, dtype=dtype,
                         device=torch.device("cpu"))
    return MHATokenToKVPoolHost(info, 2, 0, PAGE, layout, device_capacity_tokens=tokens, start_layer=0,
                                end_layer=LAYERS, pin_memory=False)


def storage_config(extra: dict, model: str = "conformance") -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                model_name=model, extra_config=extra)


def kvpool_extra(tier: dict) -> dict:
    return {"backend_name": "kvpool", "module_path": "kvpool.integrations.sglang",
            "class_name": "KvpoolHiCacheStorage", "interface_v1": 1, **tier}
