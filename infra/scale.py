"""Running at scale: torchrun process groups, FSDP2 sharding, cross-rank reductions.

    torchrun --nproc_per_node=8 train.py --preset llada8b --init_from=/models/LLaDA-8B-Instruct ...

A single process needs none of this: every function below is a no-op (or the identity) when WORLD_SIZE is
unset or 1, so train.py has one code path. With WORLD_SIZE > 1 the model is sharded with FSDP2, PyTorch's
own engine (`fully_shard` on each block, then on the root, as torchtitan does), on NCCL for CUDA and on
gloo for CPU, which is what the tests run. Multi-node is only torchrun's flags (README).

Results must not depend on the world size: train.py draws every random number from generators seeded by
(seed, step, global prompt index), builds the global batch on every rank and keeps its own rows, so a
sequence gets the same sample, mask and log-probability on any number of processes. The collectives here
only move rewards, token counts and statistics.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import sys
import threading
import traceback

import torch
import torch.distributed as dist

# -----------------------------------------------------------------------------------------------------
# process group


# How long a collective may wait for the slowest rank before the run fails. Rank 0 alone writes the final
# safetensors and fsyncs checkpoints while the others wait at a barrier: a full fine-tuning checkpoint of an
# 8B model (float32 weights and AdamW moments, about 96 GB) takes minutes on a network file system, past
# NCCL's 10-minute default. Set the environment variable to change it (minutes).
TIMEOUT_ENV = "MASKGRPO_COLLECTIVE_TIMEOUT_MIN"
DEFAULT_TIMEOUT_MIN = 60


def collective_timeout() -> datetime.timedelta:
    raw = os.environ.get(TIMEOUT_ENV, str(DEFAULT_TIMEOUT_MIN))
    try:
        minutes = float(raw)
    except ValueError:
        minutes = -1.0
    if not minutes > 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} must be a positive number of minutes (default {DEFAULT_TIMEOUT_MIN})")
    return datetime.timedelta(minutes=minutes)


# The oldest torch the multi-process path runs on (pyproject.toml; its tests were run on it): the FSDPModule
# methods below, which shard and full_weights call, are new in torch 2.8.
MIN_TORCH = (2, 8)
FSDP_METHODS = ("set_reshard_after_forward", "set_gradient_divide_factor", "set_force_sum_reduction_for_comms")


def check_torch(version: str = torch.__version__) -> None:
    """Refuse a torchrun launch on a torch older than MIN_TORCH, in one line, before any collective."""
    if tuple(int(v) for v in version.split("+")[0].split(".")[:2]) < MIN_TORCH:
        raise ValueError(f"torch {version} is too old for torchrun runs: FSDP2 needs torch >= "
                         f"{'.'.join(map(str, MIN_TORCH))} (FSDPModule.{', .'.join(FSDP_METHODS)}); install torch "
                         f">= {'.'.join(map(str, MIN_TORCH))} (pyproject.toml)")


def init(device_name: str) -> torch.device:
    """Join torchrun's process group when WORLD_SIZE > 1 and return this rank's device. device_name is
    train.py's --device ("auto", "cpu", "cuda", "cuda:N"); under torchrun each rank takes cuda:LOCAL_RANK.
    On CUDA the group is bound to that device (device_id), so NCCL sets up its communicator at once
    instead of guessing the device at the first collective."""
    want_cuda = device_name.startswith("cuda") or (device_name == "auto" and torch.cuda.is_available())
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return torch.device("cuda" if device_name == "auto" and want_cuda else
                            ("cpu" if device_name == "auto" else device_name))
    if not dist.is_initialized():
        check_torch()
        timeout = collective_timeout()
        if want_cuda:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", timeout=timeout, device_id=device)
        else:
            dist.init_process_group("gloo", timeout=timeout)
        _watch_peers()
    return torch.device("cuda", torch.cuda.current_device()) if want_cuda else torch.device("cpu")


# A rank that fails tells the others through torchrun's store (the TCPStore at MASTER_ADDR:MASTER_PORT), and
# each rank's watcher thread ends its process when it reads that: on NCCL a peer blocked in a collective (or
# in a CUDA sync waiting for one) never learns that its peer is gone, and a SIGTERM from torchrun only sets
# train.py's stop flag, which the blocked main thread cannot read; torchrun would SIGKILL it only after
# TORCH_ELASTIC_SHUTDOWN_TIMEOUT (30 s by default, minutes with the pre-emption advice), and without
# torchrun not before the collective timeout (an hour). The blocking calls release the GIL, so the watcher runs.
FAILED_POLL_S = 1.0  # how often a watcher reads the store: a peer's failure ends this rank within about this
_watcher: dict = {}


def _failed_key() -> str:  # one key per torchrun run and restart: a restarted group must not read the last one's
    return (f"maskgrpo/failed/{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}/"
            f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")


def _watch_peers() -> None:
    """Start this rank's watcher (a daemon thread with a store client of its own), if the launcher named its store."""
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ or _watcher:
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=60))
    me, key, stop = dist.get_rank(), _failed_key(), threading.Event()

    def watch():
        while not stop.wait(FAILED_POLL_S):
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


def _tell_peers_we_failed() -> None:
    """Write this rank into the store's failed key (the other ranks' watchers end them); never raises."""
    if _watcher:
        _watcher["stop"].set()  # this rank ends itself; its own watcher must not race it
        with contextlib.suppress(Exception):
            _watcher["store"].set(_watcher["key"], str(_watcher["rank"]))


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def print0(*args, **kwargs) -> None:  # one log, not world-size copies of it
    if rank() == 0:
        print(*args, **kwargs, flush=True)


def shard_rows(n: int) -> slice:  # this rank's contiguous share of n rows (n divides evenly: train.py checks)
    per = n // world()
    return slice(rank() * per, (rank() + 1) * per)


def all_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over ranks as a new tensor (t unchanged: reducing it twice must not multiply it); t in one process."""
    if world() > 1:
        t = t.clone()
        dist.all_reduce(t)
    return t


def all_max(t: torch.Tensor) -> torch.Tensor:
    """Elementwise maximum over ranks, as a new tensor (t is never changed); t itself in one process."""
    if world() > 1:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def all_gather_rows(t: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's equally sized t along dim 0, in rank order: the global tensor."""
    if world() == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(world())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def chunks(n: int, size: int) -> list[slice]:  # slices of device_batch_size rows (size 0: all n rows)
    size = size or n
    return [slice(s, s + size) for s in range(0, n, size)]


def clip_grad_norm(params, max_norm: float) -> float:
    """Clip the global gradient norm; return it as a float, the same on every rank (FSDP2: a DTensor's full value)."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def barrier() -> None:
    if world() > 1:
        dist.barrier()


def _clean_exit() -> bool:
    """Whether the exception being handled (if any) is an exit every rank takes together: none (the run
    returned), or SystemExit with an integer status (train.py's stop on SIGTERM/SIGINT, agreed over ranks
    before the checkpoint). Errors and KeyboardInterrupt may be one rank's alone."""
    exc = sys.exc_info()[1]
    return exc is None or (isinstance(exc, SystemExit) and (exc.code is None or isinstance(exc.code, int)))


def close(ok: bool | None = None) -> None:
    """Leave the process group; call it once per process on every path (process_exit does it for the
    entry points).
    ok: every rank is on its way out together, so wait for the others first; None infers it from the
    exception being handled (_clean_exit). A no-op in one process, after --dry_run, or when called twice.

    Why the barrier: without it a rank that has finished (rank 1 after the final state-dict gather,
    while rank 0 writes the safetensors) enters interpreter shutdown right after its last collective,
    while gloo's worker thread may still be releasing that collective's tensors. A native thread that
    needs the GIL during shutdown is ended by Python mid-unwind, which aborts the process ("terminate
    called without an active exception"): the likely cause of a rare abort seen at the end of finished
    runs. After the barrier every earlier collective has completed on every rank and the workers are
    idle (they still run after destroy_process_group: process_exit below ends a torchrun rank without
    interpreter teardown).
    After an error the barrier is skipped: the other ranks may be inside a collective that will never
    complete, and waiting would only turn the error into a timeout. With other ranks the group is then
    not destroyed either: under NCCL destroy_process_group may wait for the peers' pending collectives
    (up to the collective timeout, an hour), so the failing rank would never exit and torchrun never end
    the others. The process is ending (process_exit), which tells the peers through the store (their
    watchers end them within FAILED_POLL_S; gloo peers also see the closed connection at once)."""
    if not dist.is_initialized():
        return
    if ok is None:
        ok = _clean_exit()
    if not ok and world() > 1:
        return
    try:
        if ok and world() > 1:
            if dist.get_backend() == "nccl":
                dist.barrier(device_ids=[torch.cuda.current_device()])
            else:
                dist.barrier()
    finally:
        dist.destroy_process_group()


def exit_status(exc: BaseException | None) -> int:
    """The exit status Python gives a script that ends with exc (None: it returned), printing what Python
    would print: SystemExit's message, KeyboardInterrupt's 128 + SIGINT, a traceback otherwise."""
    if exc is None:
        return 0
    if isinstance(exc, SystemExit):
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    if isinstance(exc, KeyboardInterrupt):
        return 130
    traceback.print_exception(exc)
    return 1


@contextlib.contextmanager
def process_exit():
    """Wrap an entry point's body (`with scale.process_exit(): main()`): on every way out it leaves the
    process group (close, with its barrier on a clean exit), and a torchrun rank then ends the process
    at once with the status Python would have given it, after flushing stdout and stderr; in one
    process it changes nothing.

    Why not let Python end the rank: destroy_process_group does not stop gloo's threads once FSDP2 has
    run. Something FSDP2 set up still references the group after the model is freed, and two
    `pt_gloo_runloop` threads and `gloo_tcp_loop` are still running after close (torch 2.13, CPU).
    Interpreter teardown would then free the group and whatever it holds while those native threads
    run: the kind of teardown that ends in "terminate called without an active exception" (SIGABRT)
    on a rank that has finished its work. Every file the run writes is closed (checkpoints fsynced)
    by then, so teardown has nothing left to do; os._exit skips it."""
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    try:
        try:
            yield
        finally:
            close()  # sees the exception on its way out, if any, and then skips its barrier
    except BaseException as exc:  # every way out, SystemExit and Ctrl-C included
        if not launched:
            raise
        status = exit_status(exc)
        if not (isinstance(exc, SystemExit) and (exc.code is None or isinstance(exc.code, int))):
            _tell_peers_we_failed()  # an error, maybe this rank's alone: the others must not wait for it
    else:
        status = 0
    if launched:  # torchrun starts ranks unbuffered (python -u); other launchers may not
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


# -----------------------------------------------------------------------------------------------------
# FSDP2


def shard(model: torch.nn.Module, compute_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """FSDP2 over the ranks: each block is one all-gather unit, then the root (embedding, final norm and
    head). The sharded parameters keep the dtype they were loaded in (float32 master weights for full
    fine-tuning, a bf16 base for LoRA); the all-gathered copies that compute are in compute_dtype (bf16
    on CUDA); gradients are reduce-scattered in float32 so that summing 8+ ranks does not lose the small
    ones. The identity in one process. Call after add_lora (FSDP2 shards frozen and trainable parameters
    alike) and before the optimizer."""
    if world() == 1:
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # cast_forward_inputs=False: FSDP2 would otherwise cast every floating-point input of a sharded module
    # to compute_dtype, including the float32 RoPE cos/sin tables the model passes to each block; rotary
    # angles in bf16 change the logits, so the world size would change the result. The blocks cast what
    # they need themselves (model.py).
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    # Gradients are SUMMED over ranks, each rank's loss being its share of the global sum (train.backward_loss).
    # FSDP2's default is the mean, by the collective's AVG op, which gloo on torch 2.8 applies as a sum (the
    # gradients came out world-size times too large); a SUM op with divide factor 1 means the same on every
    # backend and torch version.
    for m in _fsdp_modules(model):
        m.set_force_sum_reduction_for_comms(True)
        m.set_gradient_divide_factor(1.0)
    # FSDP2 never reshards a root after its forward: for training that saves gathering the embedding and
    # head again for the backward. After a forward without gradients (scoring outside full_weights) no
    # backward follows, and a root left gathered would keep its unsharded parameters registered on the
    # module, so model.parameters() would return those (which never receive gradients) instead of the
    # sharded ones the optimizer holds: train.py's gradient clipping would then miss the root. Reshard
    # the root after such a forward; gradient forwards keep FSDP2's behaviour.
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
    """Hold the unsharded weights (one all-gather; re-entrant; a no-op in one process) for no-grad forwards whose
    number may differ between ranks, a sharded forward being a collective. model may be a hf.AdaptersOff."""
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
    """The whole model's state dict on CPU, on rank 0 (other ranks get an empty dict). A collective under
    FSDP2: every rank must call it."""
    if world() == 1:
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return sd if rank() == 0 else {}


@torch.no_grad()
def fill_shard(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy into `target`, a parameter or buffer of a model shard() split (materialised on its device),
    this rank's part of `full`, the whole tensor (on the CPU), cast to target's dtype. Only that part
    travels to the device.

    FSDP2 splits dim 0 of each parameter as torch.chunk does: ceil(rows / ranks) rows per rank, so the
    last ranks may hold fewer rows or none; the padding it adds lives in its own storage, not in the
    local tensor. Buffers are not sharded and take the whole tensor."""
    from torch.distributed.tensor import DTensor, Shard

    if isinstance(target, DTensor):
        if tuple(target.placements) != (Shard(0),):
            raise ValueError(f"fill_shard expects shard()'s dim-0 sharding, got {target.placements}")
        mesh = target.device_mesh
        parts = full.chunk(mesh.size())
        full = parts[mesh.get_local_rank()] if mesh.get_local_rank() < len(parts) else full[:0]
        target = target.to_local()
    if target.shape != full.shape:  # a different split rule would otherwise copy the wrong rows
        raise ValueError(f"local shard {tuple(target.shape)} does not match rows {tuple(full.shape)} of the full tensor")
    target.copy_(full)
