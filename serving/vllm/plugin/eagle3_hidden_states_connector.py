"""vLLM's hidden-states connector, made to write where the KV cache lives in host memory too.

Runs inside the vLLM server, never in this project's own processes: `serving.vllm.extract_server` puts
this folder (and nothing else of the project) on the server's PYTHONPATH and names the class in
`--kv-transfer-config` (`kv_connector_module_path`). vLLM's `ExampleHiddenStatesConnector` (used
with the `extract_hidden_states` speculative method) copies each finished request's states out of
its cache through a CUDA stream into pinned memory, which vLLM's CPU build cannot do ("pin_memory=
True requires a CUDA or other accelerator backend"). Promises: on a CUDA cache it is vLLM's class
unchanged; on a host cache it writes the same file (`hidden_states` [T, layers, H], `token_ids`
[T]) under the same lock protocol, with a plain copy instead of the asynchronous one.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as _base


class _Done:
    """A copy that has already happened: what the base class expects of a CUDA event."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class Eagle3HiddenStatesConnector(_base.ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: _base.PendingSave) -> None:
        if self._kv_cache is None or self._kv_cache.is_cuda:
            return super()._submit_async_write(pending)
        if not self._is_tp_rank_zero:
            return
        # The slots of the request's blocks, in order: as the base class computes them.
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slot_mapping = (offsets.reshape(1, -1) + block_ids.reshape(-1, 1) * self._block_size).flatten()
        states = _base.extract_from_kv_cache(self._kv_cache, slot_mapping, pending.token_ids.shape[0]).clone()
        tensors = {"hidden_states": states, "token_ids": pending.token_ids.clone()}
        assert self._req_futures.get(pending.req_id) is None, "Found another KV transfer request with same req_id!"
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Done()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
