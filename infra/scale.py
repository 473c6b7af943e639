"""Running at scale (torchrun): process groups, FSDP2, reductions; in one process, no-ops. The world size changes no
result: ranks build the global batch seeded by (seed, step, prompt index), keep their rows and reduce statistics."""
import contextlib
import datetime
import functools
import os
import sys
import threading
import traceback

import torch
import torch.distributed as dist

# How long a collective waits for the slowest rank, in minutes: rank 0 alone writing an 8B checkpoint with AdamW
# moments (96 GB) to a network file system while the others wait takes past NCCL's 10-minute default.
TIMEOUT_ENV = "MASKGRPO_COLLECTIVE_TIMEOUT_MIN"


def collective_timeout() -> datetime.timedelta:
    raw = os.environ.get(TIMEOUT_ENV, "60")
    with contextlib.suppress(ValueError):
        if float(raw) > 0:
            return datetime.timedelta(minutes=float(raw))
    raise ValueError(f"{TIMEOUT_ENV}={raw!r} must be a positive number of minutes (default 60)")


# The oldest torch the multi-process path runs on (pyproject.toml): these FSDPModule methods are new in torch 2.8.
MIN_TORCH = (2, 8)
FSDP_METHODS = ("set_reshard_after_forward", "set_gradient_divide_factor", "set_force_sum_reduction_for_comms")


def check_torch(version: str = torch.__version__) -> None:
    """Refuse a torchrun launch on a torch older than MIN_TORCH, in one line, before any collective."""
    need = ".".join(map(str, MIN_TORCH))
    if tuple(int(v) for v in version.split("+")[0].split(".")[:2]) < MIN_TORCH:
        raise ValueError(f"torch {version} is too old for torchrun runs: FSDP2 needs torch >= {need} "
                         f"(FSDPModule.{', .'.join(FSDP_METHODS)}); install torch >= {need} (pyproject.toml)")


def init(device_name: str) -> torch.device:
    """Join torchrun's group when WORLD_SIZE > 1; this rank's device (cuda:LOCAL_RANK, bound so NCCL connects now)."""
    want_cuda = device_name.startswith("cuda") or (device_name == "auto" and torch.cuda.is_available())
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return torch.device(("cuda" if want_cuda else "cpu") if device_name == "auto" else device_name)
    if not dist.is_initialized():  # NCCL on CUDA, gloo on the CPU (as the tests run)
        check_torch()
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if want_cuda else None
        if want_cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if want_cuda else "gloo", timeout=collective_timeout(), device_id=device)
        _watch_peers()
    return torch.device("cuda", torch.cuda.current_device()) if want_cuda else torch.device("cpu")


# A failing rank writes its rank into torchrun's store; every rank's watcher thread ends its process on reading it,
# since a peer blocked in an NCCL collective (the GIL released) would otherwise wait for the collective timeout.
_watcher: dict = {}


def _watch_peers() -> None:
    """Start this rank's watcher (a daemon thread with a store client of its own), if the launcher named its store."""
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ or _watcher:
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=60))
    env = os.environ.get  # one key per torchrun run and restart: a restarted group must not read the last one's
    key = f"maskgrpo/failed/{env('TORCHELASTIC_RUN_ID', 'none')}/{env('TORCHELASTIC_RESTART_COUNT', '0')}"
    me, stop = dist.get_rank(), threading.Event()

    def watch():
        while not stop.wait(1.0):  # a peer's failure ends this rank within about a second
            try:
                failed = store.get(key).decode() if store.check([key]) else None
            except Exception:  # the store is gone: the launcher is ending the run anyway
                return
            if failed is not None and failed != str(me) and not stop.is_set():
                print(f"rank {me}: ending, because rank {failed} failed (its error is above)", file=sys.stderr,
                      flush=True)
                os._exit(1)

    _watcher.update(store=store, key=key, stop=stop, rank=me)
    threading.Thread(target=watch, name="maskgrpo-peer-watch", daemon=True).start()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def print0(*args, **kwargs) -> None:  # one log, not world-size copies of it
    if rank() == 0:
        print(*args, **kwargs, flush=True)


def duration(seconds: float) -> str:  # the screen's time: 7s, 3m05s, 2h10m
    seconds = int(round(seconds))
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else \
        f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def shard_rows(n: int) -> slice:  # this rank's contiguous share of n rows (n divides evenly: train.py checks)
    per = n // world()
    return slice(rank() * per, (rank() + 1) * per)


def all_sum(t: torch.Tensor, **op) -> torch.Tensor:
    """Sum (or op=) over ranks as a new tensor (t unchanged: reducing twice must not multiply it); t in one process."""
    if world() > 1:
        t = t.clone()
        dist.all_reduce(t, **op)
    return t


all_max = functools.partial(all_sum, op=dist.ReduceOp.MAX)  # elementwise maximum over ranks


def all_gather_rows(t: torch.Tensor) -> torch.Tensor:
    """Every rank's equally sized t, concatenated in rank order along dim 0: the global tensor."""
    if world() == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(world())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def barrier() -> None:
    if world() > 1:  # NCCL waits on this rank's device, not a guessed one
        dist.barrier(device_ids=[torch.cuda.current_device()] if dist.get_backend() == "nccl" else None)


def _together(exc: BaseException | None) -> bool:
    """Whether every rank ends with exc together: None (returned) or an integer SystemExit (a stop agreed by ranks)."""
    return exc is None or (isinstance(exc, SystemExit) and (exc.code is None or isinstance(exc.code, int)))


def close() -> None:
    """Leave the process group (a no-op without one). On an exit every rank takes, a barrier first (a rank ending
    while gloo holds its tensors aborts); after an error with peers, none (a peer stuck in a collective hangs it)."""
    if not dist.is_initialized() or (world() > 1 and not _together(sys.exc_info()[1])):
        return
    try:
        barrier()
    finally:
        dist.destroy_process_group()


def exit_status(exc: BaseException | None) -> int:
    """The status (and stderr) Python gives a script ending with exc (None: returned; Ctrl-C: 128 + SIGINT)."""
    if _together(exc):
        return 0 if exc is None else exc.code or 0
    if isinstance(exc, KeyboardInterrupt):
        return 130
    if isinstance(exc, SystemExit):
        print(exc.code, file=sys.stderr)
    else:
        traceback.print_exception(exc)
    return 1


@contextlib.contextmanager
def process_exit():
    """`with scale.process_exit(): main()` closes the group on every way out; a torchrun rank then os._exits with
    Python's status (gloo's threads outlive the group after FSDP2: teardown would SIGABRT, torch 2.13 CPU)."""
    launched, status = int(os.environ.get("WORLD_SIZE", "1")) > 1, 0
    try:
        try:
            yield
        finally:
            close()  # sees the exception on its way out, if any, and then skips its barrier
    except BaseException as exc:  # every way out, SystemExit and Ctrl-C included
        if not launched:
            raise
        status = exit_status(exc)
        if not _together(exc) and _watcher:  # an error, maybe this rank's alone: the others must not wait for it
            _watcher["stop"].set()  # this rank ends itself; its own watcher must not race it
            with contextlib.suppress(Exception):
                _watcher["store"].set(_watcher["key"], str(_watcher["rank"]))
    if launched:  # torchrun starts ranks unbuffered (python -u); other launchers may not
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


# FSDP2 -------------------------------------------------------------------------------------------------


def shard(model: torch.nn.Module, compute_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """FSDP2 on each block, then the root (after add_lora, before the optimizer); the identity in one process. Shards
    keep their loaded dtype, compute in compute_dtype and reduce gradients in float32 (8+ ranks keep small ones)."""
    if world() == 1:
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # cast_forward_inputs=False: RoPE tables cast to bf16 would make the logits depend on the world size (model.py)
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    # Gradients are SUMMED over ranks, each rank's loss being its share of the global sum (train.backward_loss).
    # FSDP2's default AVG op is a sum on gloo under torch 2.8; SUM with divide factor 1 is the same everywhere.
    for m in _fsdp_modules(model):
        m.set_force_sum_reduction_for_comms(True)
        m.set_gradient_divide_factor(1.0)
    # FSDP2 never reshards a root after its forward; after a no-grad one outside full_weights model.parameters()
    # would then be the unsharded copies, not the optimizer's shards, and gradient clipping would miss the root.
    model.register_forward_hook(_reshard_root_without_grad)
    return model


def _reshard_root_without_grad(module, args, output) -> None:
    if not torch.is_grad_enabled() and not getattr(module, "_full_weights", False):
        module.reshard()


def _fsdp_modules(model):
    from torch.distributed.fsdp import FSDPModule  # under torchrun only: torch.distributed may be absent
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def full_weights(model):
    """Hold the unsharded weights (one all-gather) for no-grad forwards whose number may differ by rank. Re-entrant."""
    mods = _fsdp_modules(model) if world() > 1 else []
    if not mods or getattr(mods[0], "_full_weights", False):
        yield model
        return
    for m in mods:  # blocks reshard after each forward unless told not to; the root (mods[0]) never does
        if m is not mods[0]:
            m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    mods[0]._full_weights = True  # read by the root's hook, _reshard_root_without_grad
    try:
        yield model
    finally:
        mods[0]._full_weights = False
        for m in mods:
            m.reshard()
        for m in mods[1:]:
            m.set_reshard_after_forward(True, recurse=False)


def full_state_dict(model) -> dict:
    """The whole model's state dict on CPU on rank 0, an empty dict on the others; a collective under FSDP2."""
    if world() == 1:
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return sd if rank() == 0 else {}


@torch.no_grad()
def fill_shard(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy into target (a parameter or buffer of a shard() model) this rank's part of full, the whole CPU tensor;
    only that part travels. FSDP2 splits dim 0 as torch.chunk does (the last ranks may hold fewer rows or none)."""
    from torch.distributed.tensor import DTensor, Shard

    if isinstance(target, DTensor):
        if tuple(target.placements) != (Shard(0),):
            raise ValueError(f"fill_shard expects shard()'s dim-0 sharding, got {target.placements}")
        parts, i = full.chunk(target.device_mesh.size()), target.device_mesh.get_local_rank()
        full = parts[i] if i < len(parts) else full[:0]
        target = target.to_local()
    if target.shape != full.shape:  # a different split rule would otherwise copy the wrong rows
        raise ValueError(f"local shard {tuple(target.shape)} does not match rows {tuple(full.shape)} of the source")
    target.copy_(full)
