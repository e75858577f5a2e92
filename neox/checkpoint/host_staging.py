"""Host memory for a save's tensors, allocated once per run and reused by every save.

A save copies this rank's part of the training state (fp32 master weights, Adam's moments) off
the device before the next step may change it. Copying each tensor into freshly allocated
pageable memory ran at ~1 GB/s on an H200 and held the training step for the whole copy
(issue 35). Here the copies land in one buffer: pinned on CUDA, filled by non-blocking copies
and one synchronize; allocated at the first save, sized to exactly this rank's tensors, and kept
for the next save, which waits for the previous write before it copies (neox.checkpoint.io), so
one buffer suffices. Pinning takes seconds at billions of elements, so a run that saves has it
allocated in the background after its first step (`prepare`), and the first save finds it
ready. CPU ranks cannot pin: the same buffer in plain host memory, reused the same way (a copy
all the same, since the step updates the tensors in place).

The pinned buffer is plain host memory page-locked by the driver (`cuMemHostRegister`), not
torch's pinned allocator: that one rounds every block up to a power of two (a 17 GB staging at
Pythia-1.4B took 34 GB of page-locked memory), and locking is called through ctypes, which lets
go of the GIL for the seconds it takes, so the training thread runs on meanwhile. Where the
driver call is not to be had, torch's allocator is the fallback.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Optional

import torch

log = logging.getLogger(__name__)


class HostStaging:
    """One save's host copies of this rank's tensors, in a buffer reused from save to save:
    `reserve` the elements, `put` each tensor (its host view comes back), then `wait`."""

    def __init__(self) -> None:
        self.buffer: Optional[torch.Tensor] = None
        self._used = 0
        self._device: Optional[torch.device] = None
        self._allocating: Optional[threading.Thread] = None

    def prepare(self, numel: int, device: torch.device) -> None:
        """Allocate the buffer `reserve(numel, device)` will want, in a background thread."""
        self._join()
        self._allocating = threading.Thread(
            target=self._try_allocate, args=(numel, device), daemon=True
        )
        self._allocating.start()

    def _try_allocate(self, numel: int, device: torch.device) -> None:
        try:
            self._allocate(numel, device)
        except Exception as e:  # reserve allocates again, and raises, on the training thread
            log.debug("checkpoint staging: allocating ahead failed: %s", e)

    def _join(self) -> None:
        thread, self._allocating = self._allocating, None
        if thread is not None:
            thread.join()

    def reserve(self, numel: int, device: torch.device) -> None:
        """Room for `numel` fp32 elements copied from `device`: the last save's buffer when it
        is that size, else a new one (the old one freed first: one save's worth is held)."""
        self._join()
        self._allocate(numel, device)
        self._used, self._device = 0, device

    def _allocate(self, numel: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        buf = self.buffer
        if buf is None or buf.numel() != numel or buf.is_pinned() != pin:
            self.buffer = None
            unlock(buf)  # no save reads it: the last one's write has finished
            self.buffer = page_locked(numel, device) if pin else torch.empty(numel)
            size = f"{4 * numel / 1e9:.2f} GB" if numel >= 2.5e7 else f"{4 * numel / 1e6:.1f} MB"
            log.info(
                "checkpoint staging: %s of %s host memory on this rank, kept for the run's saves",
                size,
                "pinned" if pin else "plain",
            )

    def put(self, tensor: torch.Tensor) -> torch.Tensor:
        """The next free part of the buffer, shaped as `tensor`, receiving an fp32 copy of it;
        read it only after `wait`."""
        assert self.buffer is not None, "reserve first"
        n = tensor.numel()
        if self._used + n > self.buffer.numel():
            raise ValueError(
                f"checkpoint staging: {n} more elements do not fit the {self.buffer.numel()} "
                "reserved"
            )
        view = self.buffer[self._used : self._used + n]
        self._used += n
        view.copy_(tensor.detach().reshape(-1), non_blocking=self.buffer.is_pinned())
        return view.view(tensor.shape)

    def wait(self) -> None:
        """Every copy `put` queued has landed in host memory."""
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.synchronize(self._device)


# Page-locked with cuMemHostRegister (CU_MEMHOSTREGISTER_PORTABLE: every context may copy).
_PORTABLE = 0x01


def _driver() -> Optional[ctypes.CDLL]:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def page_locked(numel: int, device: torch.device) -> torch.Tensor:
    """`numel` fp32 elements of host memory, page-locked for `device`'s asynchronous copies."""
    driver = _driver()
    if driver is not None:
        torch.cuda.set_device(device)  # this thread's current context: the device's primary one
        buf = torch.zeros(numel, dtype=torch.float32)  # the pages faulted in by torch's threads
        result = driver.cuMemHostRegister_v2(
            ctypes.c_void_p(buf.data_ptr()), ctypes.c_size_t(4 * numel), ctypes.c_uint(_PORTABLE)
        )
        if result == 0:
            _locked[buf.data_ptr()] = driver
            if buf.is_pinned():  # torch sees it as pinned: its copies into it are asynchronous
                return buf
            unlock(buf)
        log.debug("checkpoint staging: cuMemHostRegister gave %s; torch's pinned memory", result)
    return torch.empty(numel, dtype=torch.float32, pin_memory=True)


_locked: dict[int, ctypes.CDLL] = {}  # address -> the driver that locked it


def unlock(buf: Optional[torch.Tensor]) -> None:
    """Undo page_locked's cuMemHostRegister before the memory can be freed."""
    if buf is not None and (driver := _locked.pop(buf.data_ptr(), None)) is not None:
        driver.cuMemHostUnregister(ctypes.c_void_p(buf.data_ptr()))
