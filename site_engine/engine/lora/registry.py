"""The adapters a site serves: on disk, in a host-memory LRU, and in the device's slots.

Adapters are the subdirectories of one directory (LoraSettings.directory), each a PEFT adapter
named by its directory. The first request for an adapter not in host memory starts its load
at once, on one of `max_loads` worker threads (reading, checking and laying out an 8B model's
rank-16 adapter takes ~60-150 ms of CPU: bench/results/engine_lora/lora_loading_cpu.md); loads
queue in their requests' arrival order beyond that. The engine's step loop goes on for everyone
else, and an adapter's requests wait in the queue until `settle` sees their own adapter's load
done. Everything here but the loading itself runs on the engine's thread (the host LRU is
changed in `settle` only, never by a worker), so no lock guards it, except `register` (any
thread) and `unregister` (the engine's), which change the directory under a lock of their own.

An adapter added at run time (`register`, the gRPC LoadAdapter) is checked in full, then linked
into the directory: the directory stays the one list of what the site serves, and a restart
serves it again. `unregister` removes the entry (a link is unlinked; a real folder is moved
under `.unloaded/`, never deleted) and drops the copies in host memory and in device slots.

Host memory keeps up to `max_cpu_loras` adapters, and with `max_cpu_bytes` at most that many
bytes of them, least recently used evicted first, never one that a live request uses (it may
then hold more for a while). The device holds up to
`max_loras` of them in slots (site_engine/engine/lora/slots.py); the scheduler admits requests of
at most that many distinct adapters at once, so every step's adapters fit.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from site_engine.engine.lora.adapter import (
    CONFIG_FILE,
    MAX_RANK,
    WEIGHTS_FILE,
    AdapterError,
    BaseShapes,
    LoraAdapter,
    check_adapter,
    read_adapter,
)
from site_engine.engine.lora.slots import LoraSlots, StepDeltas

log = logging.getLogger(__name__)
_READ_TIMES_KEPT = 16


@dataclass(frozen=True, slots=True)
class LoraSettings:
    """Where a site's adapters are and how many it keeps where. `max_rank` sizes the device
    slots (every slot is padded to it), so it is the largest rank the site accepts; `max_loads`
    adapters are read from disk at once (worker threads)."""

    directory: Path
    max_loras: int = 4
    max_cpu_loras: int = 8
    max_rank: int = 16
    max_loads: int = 4
    # Bytes the adapters in host memory may take at most (0: max_cpu_loras alone bounds them).
    max_cpu_bytes: int = 0
    # CUDA: write adapters into their slots on a stream of their own (lora/slot_copies.py). Off
    # until tests/gpu/test_lora_slot_copies.py has passed on a GPU: written on 2026-11-27 with
    # no device time left to run it, and a wrong ordering there would mix adapters' weights.
    copy_stream: bool = False
    # Slots out of the KV cache's block pool (issue 69: core/unified_slots.py): max_loras is
    # only a cap, and each resident adapter holds its bytes' worth of KV blocks.
    unified: bool = False

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )
        if not 1 <= self.max_rank <= MAX_RANK:
            raise ValueError(f"max_lora_rank must be in 1..{MAX_RANK}, got {self.max_rank}")
        if self.max_loads < 1:
            raise ValueError(f"max_lora_loads must be >= 1, got {self.max_loads}")
        if self.max_cpu_bytes < 0:
            raise ValueError(f"max_cpu_bytes must be >= 0, got {self.max_cpu_bytes}")


@dataclass(frozen=True, slots=True)
class AdapterResidency:
    """Where a site's adapters are now: in device slots, only in host memory (each sorted; the
    rest of those it serves are on disk), and the mean seconds a read from disk took lately."""

    on_device: tuple[str, ...] = ()
    in_host: tuple[str, ...] = ()
    load_s: float = 0.0
    # Since start: adapters read from disk for requests, loads refused or failed, requests that
    # waited for their adapter's load, and the seconds they waited, summed.
    loads: int = 0
    load_failures: int = 0
    waits: int = 0
    wait_s: float = 0.0


def _signature(path: Path) -> tuple[int, ...]:
    """The sizes and mtimes of an adapter's two files (-1 for one that is missing)."""
    values: list[int] = []
    for file in (CONFIG_FILE, WEIGHTS_FILE):
        try:
            stat = (path / file).stat()
            values += [stat.st_size, stat.st_mtime_ns]
        except OSError:
            values += [-1, -1]
    return tuple(values)


def lora_adapter_bytes(base: BaseShapes, settings: LoraSettings, dtype: torch.dtype) -> int:
    """Device bytes of one slot: every projection's A and B, padded to max_rank."""
    per_layer = sum(in_f + out_f for in_f, out_f in base.features.values()) * settings.max_rank
    element = torch.empty((), dtype=dtype).element_size()
    return base.num_layers * per_layer * element


def lora_slot_bytes(base: BaseShapes, settings: LoraSettings, dtype: torch.dtype) -> int:
    """Device bytes of the max_loras slots, plus the kernels' per-step buffers (a few MiB at
    most)."""
    return lora_adapter_bytes(base, settings, dtype) * settings.max_loras + (16 << 20)


def unified_adapter_blocks(
    settings: LoraSettings | None, model: nn.Module, dtype: torch.dtype, block_bytes: int
) -> int:
    """KV blocks one resident adapter holds with unified slots (SchedulerConfig.adapter_blocks;
    0: fixed slots, or no adapters). The model's shapes are read only then: a model without
    adapters need not be Llama-shaped (GPT-2 is not)."""
    if settings is None or not settings.unified:
        return 0
    return -(-lora_adapter_bytes(BaseShapes.of_model(model), settings, dtype) // block_bytes)


class AdapterRegistry:
    def __init__(
        self, settings: LoraSettings, base: BaseShapes, dtype: torch.dtype, device: torch.device
    ) -> None:
        if not settings.directory.is_dir():
            raise ValueError(f"the LoRA adapter directory {settings.directory} does not exist")
        self.settings = settings
        self._base = base
        self._dtype = dtype
        # Host copies in page-locked memory on CUDA: slot writes copy them asynchronously (the
        # caching host allocator keeps a block from reuse until its copies are done).
        self._pin = device.type == "cuda"
        self.slots = LoraSlots(
            base,
            settings.max_loras,
            settings.max_rank,
            dtype,
            device,
            settings.copy_stream,
        )
        self._host: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recently used first
        self._loading: dict[str, Future[LoraAdapter]] = {}
        # Loads start in the order their first request arrived (the pool's queue is FIFO).
        self._pool = ThreadPoolExecutor(settings.max_loads, thread_name_prefix="lora-load")
        self._files = threading.Lock()  # one directory change at a time (register/unregister)
        # Seconds the last reads from disk took (worker threads append; a deque's append and a
        # copy of it are atomic): the load time a router charges a request of a cold adapter.
        self._read_s: deque[float] = deque(maxlen=_READ_TIMES_KEPT)
        # When each request that found its adapter not in host memory asked, by adapter (the
        # engine's thread): settle() turns them into the waiting metrics.
        self._asked: dict[str, list[float]] = {}
        self._loads = self._load_failures = self._waits = 0
        self._wait_s = 0.0
        # Adapter -> (its files' sizes and mtimes, whether it can be served): served()'s checks.
        self._verdicts: dict[str, tuple[tuple[int, ...], bool]] = {}

    def entries(self) -> tuple[str, ...]:
        """Its directory's PEFT adapters by name, whether they can be served or not (what an
        operator may unload)."""
        root = self.settings.directory
        return tuple(sorted(p.name for p in root.iterdir() if (p / CONFIG_FILE).is_file()))

    def served(self) -> tuple[str, ...]:
        """The adapters this site can serve, what it advertises (SiteInfo.adapters, so the
        gateway's /v1/models): the entries whose config and weights' header pass every check
        that needs no weight data, less those a load refused (NaN weights...), each until its
        files change. The checks' verdicts are kept by the files' sizes and mtimes."""
        return tuple(name for name in self.entries() if self._loadable(name))

    def _loadable(self, name: str) -> bool:
        path = self._path(name)
        files = _signature(path)
        known = self._verdicts.get(name)
        if known is None or known[0] != files:
            try:
                check_adapter(path, self._base, self.settings.max_rank)
                known = (files, True)
            except AdapterError:
                known = (files, False)
            self._verdicts[name] = known
        return known[1]

    def _refused(self, name: str) -> None:
        """A load of `name` was refused: it is not advertised until its files change."""
        self._verdicts[name] = (_signature(self._path(name)), False)

    def check_name(self, name: str) -> None:
        """AdapterError unless `name` is an adapter of this site's directory."""
        if "/" in name or name in ("", ".", "..") or not (self._path(name) / CONFIG_FILE).is_file():
            served = ", ".join(self.served()) or "none"
            raise AdapterError(f"unknown adapter {name!r}; this site serves: {served}")

    def register(self, name: str, source: Path) -> None:
        """Serves the adapter in `source` (a directory on this machine) as `name` from now on.
        AdapterError, with nothing changed, if it does not fit the base or the name is taken.
        Callable from any thread: it reads the files off the engine's thread."""
        if "/" in name or name.startswith(".") or not name:
            raise AdapterError(f"adapter name {name!r}: non-empty, no '/', no leading '.'")
        source = source.resolve()
        if not source.is_dir():
            # Not the path itself: error messages never show the site's paths.
            raise AdapterError(f"adapter {name!r}: the path given is not a directory on the site")
        read_adapter(source, name, self._base, self.settings.max_rank, self._dtype)  # the check
        with self._files:
            entry = self._path(name)
            if entry.exists() or entry.is_symlink():
                raise AdapterError(f"adapter {name!r} is already served; unload it first")
            os.symlink(source, entry, target_is_directory=True)
        log.info("adapter %s registered from %s", name, source)

    def unregister(self, name: str) -> None:
        """Stops serving `name` (AdapterError if not served). On the engine's thread, with no
        live request of it: its host and slot copies go too, so a later adapter of the same
        name is read afresh."""
        self.check_name(name)
        with self._files:
            entry = self._path(name)
            if entry.is_symlink():
                entry.unlink()
            else:  # an operator's folder: kept aside, not deleted
                aside = self.settings.directory / ".unloaded"
                aside.mkdir(exist_ok=True)
                entry.rename(aside / f"{name}.{time.time_ns()}")
        self._host.pop(name, None)
        self.slots.drop(name)
        log.info("adapter %s unregistered", name)

    def _path(self, name: str) -> Path:
        return self.settings.directory / name

    def is_resident(self, name: str) -> bool:
        return name in self._host

    @property
    def resident(self) -> tuple[str, ...]:
        """The adapters in host memory, least recently used first."""
        return tuple(self._host)

    @property
    def loading(self) -> bool:
        return bool(self._loading)

    def request(self, name: str) -> bool:
        """True if `name` is in host memory; else its load is started (once) and False."""
        if name in self._host:
            self._host.move_to_end(name)
            return True
        if name not in self._loading:
            self._loading[name] = self._pool.submit(self._read, name)
        self._asked.setdefault(name, []).append(time.perf_counter())
        return False

    def _read(self, name: str) -> LoraAdapter:
        base, settings = self._base, self.settings
        started = time.perf_counter()
        path, rank, dtype = self._path(name), settings.max_rank, self._dtype
        adapter = read_adapter(path, name, base, rank, dtype, pin=self._pin)
        self._read_s.append(time.perf_counter() - started)
        return adapter

    def residency(self) -> AdapterResidency:
        """Engine thread: the adapters in device slots, those only in host memory (both sorted)
        and the mean seconds of the last reads from disk (0.0: none yet)."""
        device = set(self.slots.names())
        host = sorted(name for name in self._host if name not in device)
        times = list(self._read_s)
        return AdapterResidency(
            tuple(sorted(device)), tuple(host), sum(times) / len(times) if times else 0.0,
            self._loads, self._load_failures, self._waits, self._wait_s,
        )  # fmt: skip

    def load(self, name: str, in_use: Collection[str] = ()) -> LoraAdapter:
        """Reads `name` now, on this thread (an operator's preload, tests); AdapterError, with
        nothing changed, if it cannot be served."""
        self.check_name(name)
        try:
            adapter = self._read(name)
        except AdapterError:
            self._refused(name)
            raise
        self._keep(adapter, in_use)
        return adapter

    def settle(self, in_use: Callable[[], Collection[str]]) -> tuple[list[str], dict[str, str]]:
        """The loads finished since the last call: (adapters now in host memory, {adapter: why
        its load failed}). `in_use` names the adapters live requests use (never evicted)."""
        done = [name for name, future in self._loading.items() if future.done()]
        ready: list[str] = []
        failed: dict[str, str] = {}
        now = time.perf_counter()
        for name in done:
            future = self._loading.pop(name)
            asked = self._asked.pop(name, [])
            self._waits += len(asked)
            self._wait_s += sum(now - at for at in asked)
            try:
                adapter = future.result()
            except AdapterError as exc:
                failed[name] = f"adapter {name!r} cannot be served: {exc}"
                self._refused(name)
                self._load_failures += 1
                continue
            except Exception as exc:  # a broken file: its requests fail, the site serves on
                log.exception("loading adapter %s failed", name)
                # The exception's type only: its message may name the site's paths (the log
                # has it whole).
                failed[name] = f"adapter {name!r} could not be loaded ({type(exc).__name__})"
                self._load_failures += 1
                continue
            self._keep(adapter, in_use())
            self._loads += 1
            ready.append(name)
        return ready, failed

    def wait(self, timeout_s: float) -> None:
        """Blocks until a load finishes or `timeout_s` passes (nothing else to do meanwhile)."""
        if self._loading:
            wait(list(self._loading.values()), timeout=timeout_s, return_when=FIRST_COMPLETED)

    def _keep(self, adapter: LoraAdapter, in_use: Collection[str]) -> None:
        self._host[adapter.name] = adapter
        self._host.move_to_end(adapter.name)
        evictable = [n for n in self._host if n not in in_use and n != adapter.name]
        while self._over_host_bounds() and evictable:
            del self._host[evictable.pop(0)]

    def _over_host_bounds(self) -> bool:
        """More adapters in host memory than max_cpu_loras, or more bytes than max_cpu_bytes."""
        settings = self.settings
        if len(self._host) > settings.max_cpu_loras:
            return True
        return 0 < settings.max_cpu_bytes < self.host_bytes

    @property
    def host_bytes(self) -> int:
        """Bytes of the adapters in host memory."""
        return sum(adapter.num_bytes for adapter in self._host.values())

    def step(self, adapters: Sequence[str], lens: Sequence[int]) -> StepDeltas | None:
        """The deltas of a step whose chunk i (lens[i] tokens) uses adapters[i] ("": none);
        None when no row uses an adapter (the base path runs untouched)."""
        if not any(adapters):
            return None
        per_chunk = torch.tensor(self.assign(adapters))
        token_slots = per_chunk.repeat_interleave(torch.tensor(lens))
        return self.slots.step(token_slots.to(self.slots.device))

    def place(self, mapping: Sequence[tuple[str, int]]) -> None:
        """Unified slots: each resident adapter in the slot the scheduler chose, the new ones
        written (prefetched ones included, before their requests run)."""
        self.slots.place(mapping, self._fetch)

    def assign_names(self, names: Sequence[str]) -> dict[str, int]:
        """A slot for each adapter named (distinct, all of one step), written in first if need
        be: what a step does before it runs."""
        return self.slots.assign(names, self._fetch)

    def assign(self, adapters: Sequence[str]) -> list[int]:
        """Each chunk's slot (-1: "", the base model), writing adapters not in a slot into one:
        what a step does first, for all its chunks at once (an adapter written for one part of
        the step must not evict another part's)."""
        names = [name for name in adapters if name]
        if names:
            self.slots.assign(names, self._fetch)
        return self.slots.token_slots(adapters)

    def _fetch(self, name: str) -> LoraAdapter:
        adapter = self._host.get(name)
        if adapter is None:
            # Only if a running request's adapter left host memory (it should not): correct,
            # if slow, rather than failing the step.
            log.warning("adapter %s was not in host memory when its step needed it", name)
            adapter = self._read(name)
        return adapter

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
