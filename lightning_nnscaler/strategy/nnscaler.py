"""``NnScalerStrategy``: trains an unchanged LightningModule with a plan from the recipe catalog.

Lightning glue only; the plan, the generated per-rank code and the runtime do the work. Where each
step happens:

- **construction** checks the recipe and its parameters against the catalog (``recipes/*.yaml``).
- **launch** uses Lightning's launchers (``start_method="popen"``: the script is run once per
  device, as ``strategy="ddp"`` does; ``"spawn"``/``"fork"``: Lightning's multiprocessing launcher),
  or none when torchrun / SLURM created the processes. Every process joins one process group
  (gloo on CPU, NCCL on CUDA) whose collectives time out after ``timeout`` seconds.
- **setup** broadcasts rank 0's weights (as DDP does) and builds the user's optimizers over the
  full LightningModule, the way Lightning always does.
- **first training batch** (``on_train_batch_start``): the batch the step will receive is traced
  through ``training_step``, the recipe plans it for the world size (every rank plans alike, from
  the same batch; the plan hashes are compared, no shared filesystem is needed), the rank's
  generated module is loaded into a ``RankExecutor``, and the optimizers' param groups move onto
  the rank's pieces (``gradients.move_param_groups``). A batch of another shape (a ragged last
  batch, another sequence length) gets its own plan, cached by shape (at most
  ``planning.MAX_PLANS``), whose executor shares the first one's pieces, so the optimizer goes on
  training the same tensors.
- **training_step** runs ``forward_backward`` (forward, backward and the gradient reduction) and
  returns the loss, so Lightning logs it and steps the optimizer; Lightning's ``backward`` then only
  hands the step's gradients over (``gradients.GradientStash``). A parameter a rank holds whole is
  the LightningModule's own tensor (no second copy of the weights), and the replicated gradients
  are views of the reducer's buckets (no second copy of the gradients). Unless something could
  tell the difference, the optimizer steps each bucket as soon as its sum arrives, while later
  buckets are still being summed (``overlap.OverlappedStep``).
- **step time**: rank 0 predicts the first plan's step with the simulator on the spec matching its
  device and logs it with the plan; it times every optimizer step and logs the median at the end of
  the fit, with its ratio to the prediction (``strategy.step_timing``, ``strategy.plan_logging``).
- **validation / test / predict**: each step is planned forward-only with the recipe and run over the training
  plan's pieces (``strategy.evaluation``); ``predict_step``'s prediction comes back whole, each rank its own
  batch's rows. A step the plan cannot run runs on the full LightningModule, refreshed from every rank's pieces
  first (``_refresh_module``), as at the end of training; on a module built on meta it is refused.
- **pretrained weights** (``pretrained=``): each rank reads only its pieces' slices of a safetensors source
  (``checkpoint.pretrained``) for a module on meta; an eager module's values are replaced at setup.
- **checkpoints** are sharded directories: every rank writes its own pieces atomically, rank 0 the
  rest of Lightning's checkpoint and, last, the metadata (``strategy.checkpoint``,
  ``lightning_nnscaler.checkpoint``). Loading assembles the single-device checkpoint, so a run
  resumes under any recipe and world size (the first batch's plan cuts it into pieces); plain
  checkpoint files (``lightning-nnscaler ckpt merge``'s, or DDP's) load too.
- **precision**: the step is traced and run under the precision plugin's autocast (bf16-mixed,
  16-mixed); with 16-mixed, backward is seeded with the loss scale and the ``GradScaler`` becomes a
  ``ShardedGradScaler`` (an overflow on any rank skips the step on all). Norm clipping uses the
  global norm over all ranks' pieces (``_clip_grad_by_norm``).

Data, as under ``ddp`` / ``fsdp`` / ``ModelParallelStrategy``: the DataLoader's ``batch_size`` is per
data-parallel replica. The recipe's layout (``plans.layout``, known before tracing) says how many
replicas the plan has and which one each rank belongs to; ``distributed_sampler_kwargs`` describe
that group, so ranks of one replica (tensor-, sequence-parallel, co-shard pieces) load the same
samples and no rank loads samples it throws away. The step is planned for the whole batch of all
replicas; each rank's generated code reads its pieces out of its replica's batch. ``auto`` loads as
``ddp`` does (every rank its own rows; the winner is not known before the first batch): where the
winner's replicas are fewer, each step first gathers the rows a rank's code reads from the ranks that
loaded them (``planning.gather_replica_batch``), so the training is ddp's whichever plan wins.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
from datetime import timedelta
from typing import Any, Callable, Generator, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.distributed import (
    _destroy_dist_connection,
    _distributed_is_initialized,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.compile import to_uncompiled
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_debug, rank_zero_info, rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.optim import Optimizer
from typing_extensions import override

from lightning_nnscaler.capture.meta_module import has_meta_tensors
from lightning_nnscaler.codegen import module_from_source
from lightning_nnscaler.init import InitRecord, recording_init
from lightning_nnscaler.ir.box import PieceLocation, full_box
from lightning_nnscaler.ir.randomness import RandomStream
from lightning_nnscaler.plan import Plan
from lightning_nnscaler.plans.catalog import on_register
from lightning_nnscaler.runtime import TorchDistributedCommunicator
from lightning_nnscaler.runtime.compiled import CompileOptions
from lightning_nnscaler.runtime.executor import RankExecutor
from lightning_nnscaler import checkpoint as sharded_checkpoint
from lightning_nnscaler.strategy.checkpoint import (
    every_rank_is_saving, group_keys_of, held_model_pieces, held_optimizer_pieces, save_sharded,
    single_device_param_groups,
)
from lightning_nnscaler.strategy.failures import ReportingScriptLauncher
from lightning_nnscaler.strategy.evaluation import (
    EVALUATION_CONTEXTS, EvaluationCall, EvaluationPlan, forward_only, planned_prediction, planning_step, release_gradients,
)
from lightning_nnscaler.checkpoint.pretrained import PretrainedWeights, safetensors_files
from lightning_nnscaler.strategy.full_module import (
    assign_state_dict, fill_module, gather_state, held_pieces, restore_pieces,
)
from lightning_nnscaler.strategy.gradients import (
    GradientStash, broadcast_buffers, clip_grad_norm, gradient_holders, move_param_groups, piece_locations, replica_counts, zero_grad_observers,
)
from lightning_nnscaler.strategy.overlap import OverlappedStep, reasons_not_to_overlap
from lightning_nnscaler.strategy.plan_logging import log_measured_step, log_plan
from lightning_nnscaler.strategy.step_timing import PredictedStep, StepTimer, predict_step
from lightning_nnscaler.plans.layout import RecipeLayout
from lightning_nnscaler.strategy.planning import (
    MAX_PLANS, MAX_STEP_VARIANTS, KeptTargetsCheck, batch_signature, check_fits, check_step_variants, check_new_signature, check_recipe, check_supported, gather_replica_batch,
    graph_inputs, plan_training_step, random_masks_notice, reads_other_rows, share_pieces,
)

_START_METHODS = ("popen", "spawn", "fork", "forkserver")


class _NnScalerMultiProcessingLauncher(_MultiProcessingLauncher):
    """Lightning's multiprocessing launcher, subclassed only so that a spawned process unpickles this
    module (and so ``lightning_nnscaler``, which keeps torchvision importable) before Lightning."""


class NnScalerStrategy(ParallelStrategy):
    """Parallelizes a LightningModule's ``training_step`` with a recipe of the catalog.

    Args:
        recipe: A catalog recipe (``lightning_nnscaler.list_recipes()``): dp, zero1, zero3, tp, ...
        accelerator: Set by the Trainer.
        parallel_devices: Set by the Trainer from ``devices``.
        cluster_environment: Set by the Trainer (Lightning, torchrun, SLURM, ...).
        checkpoint_io: Set by the Trainer.
        precision_plugin: Set by the Trainer from ``precision`` (32-true, bf16-mixed, bf16-true, 16-mixed).
        timeout: Seconds any collective may wait before it fails (a dead rank fails the run).
        start_method: ``"popen"`` runs the script once per device (like ``strategy="ddp"``);
            ``"spawn"``/``"fork"`` use Lightning's multiprocessing launcher.
        overlap_optimizer: Step the optimizer over each gradient bucket as soon as its sum arrives,
            while later buckets are still summed (``strategy.overlap``; the same update bit for bit).
            It turns itself off, falling back to DDP's order, where a hook, clipping, a loss scaler
            or the optimizer could tell the difference (``overlap_off_reasons`` says why).
        bucket_cap_mb: Size of the gradient buckets summed during backward, in MiB (DDP's
            ``bucket_cap_mb``; default 25).
        pretrained: Pretrained weights to start from: a ``.safetensors`` file or a Hugging Face style directory
            (``model.safetensors``, or shards with their ``*.safetensors.index.json``), stored under the module's
            state_dict keys. A module built on meta (``Trainer.init_module()``, ``configure_model()``) takes its pieces
            from them instead of its recorded initialization, each rank reading only its own pieces' slices
            (``checkpoint.pretrained``); an eager module's values are replaced by them at setup (every rank reads them
            whole). A checkpoint loaded with ``ckpt_path`` wins; ``bytes_read`` counts what a rank read.
        compile: Run each generated segment function (forward, and its backward through AOTAutograd) under
            ``torch.compile``, communication as graph breaks (``runtime.compiled``). Off by default. A module the
            user passed through ``torch.compile`` turns it on with that call's backend and options.
        compile_options: Keyword arguments of ``torch.compile`` for the segments (backend, mode, options, ...);
            only with ``compile=True``.
        allow_partial: Accept a plan that leaves whole (replicated) some ops the recipe means to
            split, e.g. attention whose heads its pieces do not divide, with a ``PartialPlanWarning``
            saying how much of the model was split. By default such a recipe is refused at setup.
        **recipe_params: The recipe's parameters, e.g. ``degree=2`` for tp.

    Raises:
        RecipeError: the recipe is not in the catalog, or a parameter is unknown, missing, of the wrong type or below its minimum.
        ValueError: a ``timeout``, ``start_method`` or ``bucket_cap_mb`` that cannot work; ``compile_options`` without
            ``compile=True``, or naming what ``torch.compile`` does not take.
        CheckpointError: ``pretrained`` is no safetensors file or directory of them; at setup, a key of the module is
            not in it or is stored with another shape (the message names the key and both shapes).
    """

    def __init__(
        self,
        recipe: str = "dp",
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        timeout: float = 60.0,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        allow_partial: bool = False,
        overlap_optimizer: bool = True,
        bucket_cap_mb: Optional[float] = None,
        pretrained: Optional[Union[str, os.PathLike]] = None,
        compile: bool = False,
        compile_options: Optional[dict[str, Any]] = None,
        **recipe_params: Any,
    ) -> None:
        super().__init__(accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin)
        check_recipe(recipe, recipe_params)
        if start_method not in _START_METHODS:
            raise ValueError(f"NnScalerStrategy(start_method={start_method!r}): use one of {', '.join(_START_METHODS)}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise ValueError(
                f"NnScalerStrategy(timeout={timeout!r}): give the seconds a collective may wait before it fails, a finite "
                "number > 0 (default 60.0; ddp's timedelta(minutes=30) is timeout=1800); with 0 no collective could complete"
            )
        if bucket_cap_mb is not None and not bucket_cap_mb > 0:
            raise ValueError(f"NnScalerStrategy(bucket_cap_mb={bucket_cap_mb!r}): give a positive size in MiB, or None for 25")
        if compile_options is not None and not compile:
            raise ValueError(f"NnScalerStrategy(compile_options={compile_options!r}) compiles nothing without compile=True")
        self.recipe = recipe
        self.recipe_params = dict(recipe_params)
        self.compile = CompileOptions(dict(compile_options or {})) if compile else None
        """How the segment functions are compiled (``compile=True``); None: eagerly, unless the module was compiled."""
        self.timeout = timeout
        self.allow_partial = allow_partial
        self.overlap_optimizer = overlap_optimizer
        self.bucket_cap_mb = bucket_cap_mb
        self.pretrained = pretrained
        if pretrained is not None:
            safetensors_files(pretrained)  # no such file, or no safetensors in it: refused before anything runs
        self._pretrained: Optional[PretrainedWeights] = None
        self._pretrained_pending = pretrained is not None
        """An eager module's values are still to be replaced by the pretrained weights (at the first setup, unless a
        checkpoint was loaded before)."""
        self.overlap_off_reasons: list[str] = []
        """Why the optimizer step is not overlapped with the gradient sums (set at the first batch)."""
        self._overlap: Optional[OverlappedStep] = None
        self._start_method = start_method
        self._num_nodes = 1
        self.plan: Optional[Plan] = None
        self.executor: Optional[RankExecutor] = None
        self._gradient_stash: Optional[GradientStash] = None
        self._replicas: dict[int, int] = {}
        self._group_keys: list[list[list[str]]] = []
        self._locations: dict[int, PieceLocation] = {}
        self._module_is_stale = False
        self._evaluation_plans: dict[tuple, Optional[list[EvaluationPlan]]] = {}
        """Evaluation steps' plans by ``EvaluationCall.key``; None where the step runs on the full module."""
        self._unplanned: dict[tuple, str] = {}
        """Why each evaluation step (by ``EvaluationCall.key``) runs on the full module."""
        self._init_records: list[InitRecord] = []
        """What ``tensor_init_context`` recorded: the initial values of the module's meta tensors."""
        self._pending_pieces: Optional[str] = None
        """A sharded checkpoint to read this rank's slices of once the plan says which (a module built on meta)."""
        self._checkpoint_bytes_read = 0
        """Bytes this rank read from sharded checkpoints per slice (``restore_pieces``)."""
        self.compile_context: Any = None
        """The ``torch.compile`` context of a compiled module the user passed (its steps are planned uncompiled, and
        its segments compiled with it unless ``compile=True`` gave options)."""
        self._layout: Optional[RecipeLayout] = None
        self.predicted_step: Optional[PredictedStep] = None
        """Rank 0: the simulated step of the first plan (``step_timing.predict_step``; None if it failed)."""
        self.step_timer: Optional[StepTimer] = None
        """Rank 0: this fit's optimizer step times (``step_timing.StepTimer``); its median is logged at the end."""
        self._op_prices: dict[str, float] = {}
        """The op times ``balance="measured"`` cut the stages by, by op name (rank 0's, on every rank): later plans reuse them."""

    @property
    def bytes_read(self) -> int:
        """Bytes this rank read per slice, from checkpoints (``restore_pieces``) and pretrained weights."""
        return self._checkpoint_bytes_read + (self._pretrained.bytes_read if self._pretrained is not None else 0)

    # --- devices, ranks, launch ----------------------------------------------------------------

    @property
    def _lightning_module(self) -> Optional[LightningModule]:
        return self.__dict__.get("_module_uncompiled")

    @_lightning_module.setter
    def _lightning_module(self, module: Optional[LightningModule]) -> None:
        """Lightning hands the strategy a ``torch.compile``'d module unwrapped, its steps still compiled
        (``from_compiled``); the plan captures the steps as written, so they are uncompiled here, before
        Lightning checks the strategy supports compilation, and the compile context is kept: the generated
        segments run under it (``segment_compile``), as ddp runs the compiled module."""
        if module is not None and getattr(module, "_compiler_ctx", None) is not None:
            self.compile_context = module._compiler_ctx["dynamo_ctx"]
            to_uncompiled(module)
            rank_zero_info(
                f"NnScalerStrategy plans {type(module).__name__} as written and compiles the generated per-rank segments "
                "with the module's torch.compile options"
            )
        self.__dict__["_module_uncompiled"] = module

    @property
    def segment_compile(self) -> Optional[CompileOptions]:
        """How the executors compile the segments: ``compile=True``'s options, else a compiled module's context, else None."""
        if self.compile is None and self.compile_context is not None:
            return CompileOptions(compiler=self.compile_context)
        return self.compile

    @property
    @override
    def root_device(self) -> torch.device:
        """This process's device."""
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        """Nodes the Trainer was given (``num_nodes``)."""
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        """Processes on this node (one per device)."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """True: makes the Trainer put a DistributedSampler (with ``distributed_sampler_kwargs``) in the loaders."""
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """The recipe's data-parallel group: ``num_replicas`` replicas, this rank's replica index.

        Ranks of one replica get the same samples (the sampler shuffles with Lightning's seed, alike on every rank).
        """
        layout = self.layout
        return {"num_replicas": layout.data_parallel, "rank": layout.replica(self.global_rank)}

    @property
    def layout(self) -> RecipeLayout:
        """The recipe's layout over this run's ranks (device grid, data-parallel replicas, head pieces).

        Raises:
            MisconfigurationException: the recipe's parameters do not fit the world size.
        """
        if self._layout is None or self._layout.grid.size != self.world_size:
            module = self.lightning_module if self.lightning_module is not None else torch.nn.Module()
            self._layout = check_fits(module, self.recipe, self.recipe_params, self.world_size, allow_partial=self.allow_partial)
        return self._layout

    @override
    def _configure_launcher(self) -> None:
        """Lightning's script launcher (``popen``; reporting a rank's failure to the others, ``strategy.failures``)
        or multiprocessing launcher, as for DDP."""
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = ReportingScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _NnScalerMultiProcessingLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        """Join the process group: gloo on CPU, NCCL on CUDA, collectives timing out after ``timeout`` s.

        The group is destroyed at interpreter exit whatever the backend (Lightning does so for NCCL only):
        gloo's worker threads still holding finished work when the interpreter finalizes abort the process
        (SIGABRT, "terminate called without an active exception") after a successful fit."""
        super().setup_environment()
        self.set_world_ranks()
        backend = "nccl" if self.root_device.type == "cuda" else "gloo"
        _init_dist_connection(self.cluster_environment, backend, timeout=timedelta(seconds=self.timeout))
        atexit.unregister(_destroy_dist_connection)  # once, however many fits
        atexit.register(_destroy_dist_connection)

    def set_world_ranks(self) -> None:
        """Global rank and world size from the node rank, local rank and devices per node."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # --- setup -----------------------------------------------------------------------------------

    @override
    def setup(self, trainer: Trainer) -> None:
        """Move the full module to the device with rank 0's weights and build the user's optimizers over it.

        Raises:
            MisconfigurationException: manual optimization, or a recipe that does not fit the devices.
        """
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:  # Trainer(sync_batchnorm=True), as DDPStrategy: the plan syncs SyncBatchNorm's sums
            self.model = self._layer_sync.apply(self.model)
        if fitting:
            assert self.lightning_module is not None
            self._layout = check_supported(
                self.lightning_module, self.recipe, self.recipe_params, self.world_size, allow_partial=self.allow_partial
            )
        if self.pretrained is not None:  # every key and shape checked before anything is planned
            read_before = self._pretrained.bytes_read if self._pretrained is not None else 0
            self._pretrained = PretrainedWeights.of_module(self.pretrained, self.lightning_module)
            self._pretrained.bytes_read = read_before
            if self._pretrained_pending and not has_meta_tensors(self.lightning_module):  # a module on meta reads per piece
                self._pretrained.load_into(self.lightning_module)
            self._pretrained_pending = False
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._broadcast_module_state()
        if fitting:
            self.executor = self.plan = None  # planned again from the first batch, for the new optimizers
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            self._share_inf_checks()
            _optimizers_to_device(self.optimizers, self.root_device)
            # The precision plugin's norm clipping sees only this rank's pieces: clip by the global norm instead.
            self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm  # type: ignore[method-assign]

    def _share_inf_checks(self) -> None:
        """16-mixed: the precision plugin's ``GradScaler`` becomes a ``ShardedGradScaler`` with the same
        settings, whose inf/NaN check is all-reduced, so a step skipped on one rank's pieces is skipped on all."""
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is None or isinstance(scaler, ShardedGradScaler) or self.world_size == 1:
            return
        self.precision_plugin.scaler = ShardedGradScaler(  # type: ignore[attr-defined]
            device=self.root_device.type, init_scale=scaler.get_scale(), growth_factor=scaler.get_growth_factor(),
            backoff_factor=scaler.get_backoff_factor(), growth_interval=scaler.get_growth_interval(), enabled=scaler.is_enabled(),
        )

    def _broadcast_module_state(self) -> None:
        """Start every rank from rank 0's weights, as DDP does (a script run per device may seed differently).

        A module built on meta has no weights to broadcast: every rank must have recorded the same initial values.

        Raises:
            MisconfigurationException: ranks built the module on meta under different seeds.
        """
        if self.world_size == 1 or not _distributed_is_initialized():
            return
        assert self.lightning_module is not None
        tensors = [*self.lightning_module.parameters(), *self.lightning_module.buffers()]
        if any(tensor.is_meta for tensor in tensors):
            digests = self._all_gather_objects([record.digest() for record in self._init_records])
            if any(digest != digests[0] for digest in digests):
                raise MisconfigurationException(
                    "the ranks built the model on the meta device with different initial values (the seed differs per rank), and "
                    "a module on meta has no weights to broadcast: call lightning.seed_everything(seed) before building it"
                )
        with torch.no_grad():
            for tensor in tensors:
                if not tensor.is_meta:
                    dist.broadcast(tensor.data, src=0)

    @override
    def model_to_device(self) -> None:
        """Move the LightningModule (the source of the pieces) to the device; tensors on meta stay there."""
        assert self.model is not None
        if has_meta_tensors(self.model):
            self.model._apply(lambda tensor: tensor if tensor.is_meta else tensor.to(self.root_device))
        else:
            self.model.to(self.root_device)

    @override
    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """Build the module on the meta device while recording its initialization (``lightning_nnscaler.init``):
        each rank then materializes only its own pieces, with the values the same seed gives on one device, and no
        rank holds the whole model. ``Trainer.init_module()`` and ``configure_model()`` run under it;
        ``init_module(empty_init=False)`` builds the module on the device instead, as ``ddp`` does."""
        if empty_init is False:
            with super().tensor_init_context(empty_init=False):
                yield
            return
        with recording_init(self.root_device) as record, self.precision_plugin.tensor_init_context():
            yield
        self._init_records.append(record)

    def _materialize_piece(self, location: PieceLocation, tensor: Tensor) -> Tensor:
        """The values of ``location`` of a module tensor on meta, from the initialization recorded for it.

        Raises:
            MisconfigurationException: the tensor lies on meta but was not built under ``tensor_init_context``.
        """
        if self._pretrained is not None and location.state_key in self._pretrained.names:
            return self._pretrained.read_piece(location, tensor.dtype).to(self.root_device)
        record = next((record for record in self._init_records if record.owns(tensor)), None)
        if record is None:
            raise MisconfigurationException(
                f"{location.state_key} lies on the meta device but was not built under NnScalerStrategy's tensor_init_context, so "
                "it has no values: build the model inside `with trainer.init_module():` or in configure_model(), or give it real values"
            )
        if location.chunk is None:
            return record.materialize_tensor(tensor, location.box, device=self.root_device, name=location.state_key)
        return location.take(record.materialize_tensor(tensor, device=self.root_device, name=location.state_key))

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Plan the step from the first batch it will receive, again for each new batch shape, and again where the
        step would decide otherwise on per-step values (a guard of every plan so far fails; see the module docstring)."""
        signature = batch_signature(batch)
        values = self._step_quantities(batch_idx)
        known = self._plans_by_shape.get(signature, []) if self.executor is not None else []
        holding = next(((plan, executor) for plan, executor in known if plan.step_values.failed_guard(values) is None), None)
        if holding is None:
            self._build_executor(batch, batch_idx, signature)
        else:
            self.plan, self.executor = holding

    def _step_quantities(self, batch_idx: int) -> dict[str, int]:
        trainer = self.lightning_module.trainer
        return {"batch_idx": batch_idx, "global_step": trainer.global_step, "current_epoch": trainer.current_epoch}

    def _build_executor(self, batch: Any, batch_idx: int, signature: tuple) -> None:
        """Plan for batches of ``signature`` at ``batch_idx``; a plan after the first shares the first's pieces
        (``planning.share_pieces``)."""
        module = self.lightning_module
        assert module is not None
        rank, world_size = self.global_rank, self.world_size
        first = self.executor is None
        if first:
            self._evaluation_plans = {}  # planned before training, over the module's tensors: share the training pieces from now
            self._plans_by_shape: dict[tuple, list[tuple[Plan, RankExecutor]]] = {}
            self._kept_targets_check = KeptTargetsCheck()
        if signature in self._plans_by_shape:  # every rank sees the same step values: all plan again alike
            check_step_variants(module, [plan for plan, _ in self._plans_by_shape[signature]], self._step_quantities(batch_idx))
        else:
            check_new_signature(signature, list(self._plans_by_shape), self._all_gather_objects)
        # Traced under the precision's autocast, as it will run: the plan's dtypes are what the step computes.
        with self.precision_plugin.train_step_context():
            plan = plan_training_step(
                module, batch, self.recipe, self.recipe_params, world_size, self._all_gather_objects, allow_partial=self.allow_partial,
                batch_idx=batch_idx, bucket_bytes=None if self.bucket_cap_mb is None else int(self.bucket_cap_mb * 2**20),
                known_prices=self._op_prices,
            )
        code = module_from_source(plan.sources[rank], f"nnscaler_rank{rank}_{plan.plan_hash[:12]}")
        if not first:
            assert self.executor is not None
            first_executor = next(iter(self._plans_by_shape.values()))[0][1]
            self.plan, self.executor = plan, share_pieces(first_executor, code, plan, rank)
            self._plans_by_shape.setdefault(signature, []).append((plan, self.executor))
            rank_zero_info(
                f"NnScalerStrategy: plan {sum(map(len, self._plans_by_shape.values()))} for batch shapes {list(signature)} "
                f"({plan.plan_hash[:12]}; {len(plan.step_values.guards)} decisions on per-step values)"
            )
            return
        notice = random_masks_notice(plan)
        if notice:
            rank_zero_warn(notice)
        state = {**dict(module.named_parameters(remove_duplicate=False)), **dict(module.named_buffers(remove_duplicate=False))}
        communicator = TorchDistributedCommunicator(timeout=self.timeout)
        self.executor = RankExecutor(
            code, rank, state, plan.graph.constant_values, communicator, self.root_device, input_offsets=plan.input_offsets(rank),
            share_parameters=True,
            materialize=self._materialize_piece, compile=self.segment_compile,
        )
        self.plan = plan
        self._plans_by_shape[signature] = [(plan, self.executor)]
        self._group_keys = [move_param_groups(optimizer, module, self.executor) for optimizer in self.optimizers]
        self._locations = piece_locations(self.executor)
        if self._pending_pieces is not None:  # resuming a module built on meta: this rank's slices of the checkpoint
            self._checkpoint_bytes_read += restore_pieces(self._pending_pieces, module, self.executor, self.optimizers, self._locations)
            self._pending_pieces = None
        trainer = module.trainer
        self._gradient_stash = GradientStash(gradient_holders(self.executor), keep_earlier=bool(zero_grad_observers(module, trainer.callbacks)))
        self._replicas = replica_counts(self.executor)
        self.overlap_off_reasons = ["overlap_optimizer=False"] if not self.overlap_optimizer else reasons_not_to_overlap(
            module, self.optimizers, trainer.callbacks, clipping=bool(trainer.gradient_clip_val),
            scaling=getattr(self.precision_plugin, "scaler", None) is not None,
        )
        self._overlap = None if self.overlap_off_reasons else OverlappedStep(self.optimizers[0])
        rank_zero_debug(f"NnScalerStrategy: optimizer step overlapped with the gradient sums: {', '.join(self.overlap_off_reasons) or 'yes'}")
        self.predicted_step = predict_step(plan, self.root_device) if self.global_rank == 0 else None
        log_plan(module.loggers, plan, self.predicted_step)  # rank 0: recipe, parameters, plan hash, memory estimate, code, prediction

    # --- training --------------------------------------------------------------------------------

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Tensor:
        """One step of the parallelized ``training_step``; returns the whole loss (equal on every rank).

        The gradients are those of Lightning's ``closure_loss`` (the loss divided by
        ``accumulate_grad_batches``); they are summed over ranks on the last batch of an
        accumulation window only (DDP's ``no_sync`` on the others).
        """
        assert self.lightning_module is not None and self.plan is not None and self._gradient_stash is not None
        self.plan.step_values.check(self.lightning_module)  # a plain attribute the traced step read must not change
        batch = kwargs.get("batch", args[0] if args else None)
        batch_idx = kwargs.get("batch_idx", args[1] if len(args) > 1 else 0)
        self.executor.set_constants(self.plan.step_values.constants(self._step_quantities(batch_idx)))  # lifted step values
        trainer = self.lightning_module.trainer
        inputs = graph_inputs(self.plan, batch, self.layout)
        self._kept_targets_check(self.plan, inputs, self.global_rank, self._all_gather_objects)  # at each plan's first step
        loaded_inputs = inputs  # this rank's replica's rows, as the DataLoader gave them
        if reads_other_rows(self.layout, self.plan.data_layout, self.world_size):  # auto: the winner's rows
            inputs = gather_replica_batch(inputs, self.layout, self.plan.data_layout, self.global_rank, self._all_gather_tensor)
        scaler = getattr(self.precision_plugin, "scaler", None)  # 16-mixed: backward of the loss times the loss scale
        scale: float | Tensor = 1.0 / trainer.accumulate_grad_batches
        if scaler is not None:  # the scale as a tensor (GradScaler.get_scale() would wait for the device)
            scale = scaler.scale(torch.ones((), device=self.root_device)) * scale
        reduce = not trainer.fit_loop._should_accumulate()
        # Lightning's zero_grad comes between training_step and backward on a window's first batch.
        first_of_window = batch_idx % trainer.accumulate_grad_batches == 0
        stream = random_stream(trainer.global_step, batch_idx % trainer.accumulate_grad_batches)
        if reduce:
            broadcast_buffers(self.executor, self.plan, self.world_size)
        replica_buffers = self.plan.replica_buffers  # an EMA, a counter: per replica, from the values before the step
        buffers_before = self.executor.whole_buffers(replica_buffers.shapes) if replica_buffers is not None else {}
        self.executor.reducer.on_bucket_reduced = self._overlap.step_bucket if self._overlap is not None and reduce else None
        with self.precision_plugin.train_step_context():
            loss = self._gradient_stash.run_step(
                lambda: self.executor.forward_backward(inputs, loss_scale=scale, reduce_gradients=reduce, random_stream=stream),
                zero_grad_follows=first_of_window,
            )
        if replica_buffers is not None and set(replica_buffers.shapes) <= set(buffers_before):
            self.executor.write_whole_buffers(replica_buffers.compute(loaded_inputs, buffers_before))
        if self.plan.logged is not None:  # what training_step logs, this rank's replica's values (as under DDP)
            replica = self.layout.replica(self.global_rank)
            for name, value, options in self.plan.logged.logs(self.executor.values, replica, self.lightning_module):
                self.lightning_module.log(name, value, **options)
        return loss

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        """Hand over the gradients ``training_step`` computed (its generated step ran backward already).

        Lightning's backward hooks still run.
        """
        assert self.lightning_module is not None and self._gradient_stash is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self._gradient_stash.apply()
        if self._overlap is not None:  # Lightning's optimizer.step updates only what no bucket stepped
            self._overlap.hide_stepped()
        return self.precision_plugin.post_backward(closure_loss, self.lightning_module)

    @override
    def optimizer_step(
        self, optimizer: Optimizer, closure: Callable[[], Any], model: Optional[Union[LightningModule, torch.nn.Module]] = None, **kwargs: Any
    ) -> Any:
        """Lightning's optimizer step (its closure runs ``training_step`` and ``backward``), then the
        executor's (ZeRO) bookkeeping; timed for the measured step (``step_timing.StepTimer``)."""
        timer = self.step_timer
        if timer is not None:
            timer.start()
        try:
            output = super().optimizer_step(optimizer, closure, model, **kwargs)
        finally:
            if self._overlap is not None:
                self._overlap.restore()
        if self.executor is not None:
            self.executor.after_optimizer_step()  # ZeRO gathers the updated chunks, or releases the boxes
            self._module_is_stale = True
        if timer is not None:
            timer.stop()
        return output

    def _clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        """Norm clipping by the norm over every rank's pieces (a replicated box counted once)."""
        assert self.executor is not None
        world = tuple(range(self.world_size))
        all_reduce = (lambda tensor: self.executor.communicator.all_reduce(tensor, world)) if len(world) > 1 else (lambda tensor: tensor)
        parameters = [parameter for group in optimizer.param_groups for parameter in group["params"]]
        clip_grad_norm(parameters, float(clip_val), self._replicas, all_reduce)

    # --- evaluation and the full module ----------------------------------------------------------

    def _refresh_module(self) -> None:
        """Write every rank's current pieces into the full LightningModule, one piece at a time (a collective:
        all ranks call it; ``strategy.full_module``)."""
        if self.executor is None or not self._module_is_stale or has_meta_tensors(self.lightning_module):
            return  # a module built on meta stays there: full_state_dict() gives its values
        assert self.lightning_module is not None
        fill_module(
            self.lightning_module, held_pieces(self.executor), self.global_rank, self.world_size, self._all_gather_objects,
            self._broadcast_tensor,
        )
        self._module_is_stale = False

    def _broadcast_tensor(self, tensor: Tensor, src: int) -> None:
        if self.world_size > 1:
            dist.broadcast(tensor, src=src)

    def _all_gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, by rank (a collective)."""
        if self.world_size == 1:
            return [obj]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def _all_gather_tensor(self, tensor: Tensor) -> list[Tensor]:
        """Every rank's ``tensor`` (one shape on all ranks), by rank (a collective)."""
        gathered = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(gathered, tensor)
        return gathered

    @override
    def on_validation_start(self) -> None:
        """Keep the full module current for the loop's hooks (the steps run through the plan, ``strategy.evaluation``);
        also ``on_test_start``, and ``on_predict_start`` (predict with the current weights, refreshed from the pieces)."""
        self._start_evaluation()

    on_test_start = on_validation_start  # the same refresh before testing
    on_predict_start = on_validation_start  # and before predicting

    def _start_evaluation(self) -> None:
        """Refresh the full module; outside a fit, drop the last step's gradients no one can read (``strategy.evaluation``)."""
        self._refresh_module()
        module = self.lightning_module
        if self.executor is not None and module is not None and module.trainer.state.fn != TrainerFn.FITTING:
            release_gradients(self.executor, module)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """The user's ``validation_step`` planned forward-only over the training pieces (``strategy.evaluation``)."""
        return self._evaluation_step(EvaluationCall.of("validation_step", args, kwargs), args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """The user's ``test_step`` planned forward-only over the training pieces (``strategy.evaluation``)."""
        return self._evaluation_step(EvaluationCall.of("test_step", args, kwargs), args, kwargs)

    def _evaluation_step(self, call: EvaluationCall, args: tuple, kwargs: dict[str, Any]) -> Any:
        module = self.lightning_module
        assert module is not None
        context = getattr(self.precision_plugin, EVALUATION_CONTEXTS[call.step])
        held = self._evaluation_plan(call)
        if held is None:
            self._refuse_on_meta(call.step, self._unplanned.get(call.key, ""))
            self._refresh_module()
            with context():
                return getattr(module, call.step)(*args, **kwargs)
        plan, executor = held.plan, held.executor
        executor.set_constants(plan.step_values.constants(self._step_quantities(call.batch_idx)))
        inputs = graph_inputs(plan, call.batch, self.layout)
        if reads_other_rows(self.layout, plan.data_layout, self.world_size):
            inputs = gather_replica_batch(inputs, self.layout, plan.data_layout, self.global_rank, self._all_gather_tensor)
        with context():
            value = forward_only(executor, inputs)
        if plan.logged is not None:  # this rank's replica's values, as under ddp
            for name, logged, options in plan.logged.logs(executor.values, self.layout.replica(self.global_rank), module):
                module.log(name, logged, **options)
        if held.prediction is not None:  # this rank's replica's rows of the prediction, as ddp's rank predicts its own batch
            return held.prediction.of_replica(plan, executor, self.layout.replica(self.global_rank))
        return value if plan.returned == "value" else None

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The user's ``predict_step`` planned forward-only over the training pieces (``strategy.evaluation``); each rank
        gets its own batch's prediction, whole."""
        return self._evaluation_step(EvaluationCall.of("predict_step", args, kwargs), args, kwargs)

    def _refuse_on_meta(self, step: str, reason: str = "") -> None:
        """Raise where a step must run on the full module but the module was built on the meta device.

        Raises:
            MisconfigurationException: naming the step and what to do instead.
        """
        module = self.lightning_module
        if module is not None and has_meta_tensors(module):
            raise MisconfigurationException(
                f"{type(module).__name__}.{step} must run on the whole module (the plan cannot run it{': ' + reason if reason else ''}), "
                "but the module was built on "
                "the meta device (Trainer.init_module() / configure_model()) and no rank holds it whole. Run it on a module with "
                "real weights: strategy.full_state_dict() or `lightning-nnscaler ckpt merge` give them"
            )

    def _evaluation_plan(self, call: EvaluationCall) -> Optional[EvaluationPlan]:
        """The plan and executor for ``call`` (planned on the first call of its shapes and per-step outcomes), or
        None where the step runs on the full module (said once per step and shapes)."""
        module = self.lightning_module
        assert module is not None
        known = self._evaluation_plans.get(call.key, [])
        if known is None:
            return None
        values = self._step_quantities(call.batch_idx)
        for held in known:
            if held.plan.step_values.failed_guard(values) is None:
                held.plan.step_values.check(module)
                return held
        reason, held = self._plan_evaluation(call, known)
        if held is None:
            self._evaluation_plans[call.key] = None
            self._unplanned[call.key] = reason
            rank_zero_warn(f"NnScalerStrategy runs {type(module).__name__}.{call.step} on the full LightningModule: {reason}")
            return None
        self._evaluation_plans[call.key] = [*known, held]
        return held

    def _plan_evaluation(self, call: EvaluationCall, known: list) -> tuple[str, Optional[EvaluationPlan]]:
        """Plan ``call``'s step and build its executor on every rank alike, or say why not (the same on every rank)."""
        if self.recipe == "auto":
            return "recipe 'auto' searches plans for training_step only", None
        if len(known) >= MAX_STEP_VARIANTS or len(self._evaluation_plans) >= MAX_PLANS:
            return f"it was planned for {MAX_PLANS} batch shapes or {MAX_STEP_VARIANTS} per-step outcomes already", None
        context = getattr(self.precision_plugin, EVALUATION_CONTEXTS[call.step])
        held, reason = None, ""
        try:
            with context(), planning_step(self.lightning_module, call.step) as prediction:
                plan = plan_training_step(
                    self.lightning_module, call.batch, self.recipe, self.recipe_params, self.world_size, self._all_gather_objects,
                    allow_partial=self.allow_partial, batch_idx=call.batch_idx, step=call.step, step_args=call.extra,
                    known_prices=self._op_prices,
                )
            prediction = planned_prediction(plan, prediction) if prediction is not None else None
            held = EvaluationPlan(plan, self._evaluation_executor(plan), prediction)
        except (MisconfigurationException, ValueError) as error:
            reason = str(error)
        if not all(self._all_gather_objects(held is not None)):  # a plan whose pieces differ on one rank runs nowhere
            return reason or "on another rank the plan holds other pieces than training's", None
        return reason, held

    def _evaluation_executor(self, plan: Plan) -> RankExecutor:
        """An executor of ``plan`` over the training plan's pieces, or over copies of the module's tensors before training
        planned (dropped when it does).

        Raises:
            ValueError: the plan holds other pieces than the training plan (``RankExecutor.sharing_pieces``).
        """
        rank = self.global_rank
        code = module_from_source(plan.sources[rank], f"nnscaler_rank{rank}_{plan.plan_hash[:12]}")
        if self.executor is not None:
            first_executor = next(iter(self._plans_by_shape.values()))[0][1]
            return first_executor.sharing_pieces(code, plan.graph.constant_values, plan.input_offsets(rank))
        module = self.lightning_module
        assert module is not None
        state = {**dict(module.named_parameters(remove_duplicate=False)), **dict(module.named_buffers(remove_duplicate=False))}
        executor = RankExecutor(
            code, rank, state, plan.graph.constant_values, TorchDistributedCommunicator(timeout=self.timeout), self.root_device,
            input_offsets=plan.input_offsets(rank), share_parameters=False,  # its reducer must not hook the module's tensors
            materialize=self._materialize_piece, compile=self.segment_compile,
        )
        if self._pending_pieces is not None:  # evaluating a checkpoint of a module built on meta
            self._checkpoint_bytes_read += restore_pieces(self._pending_pieces, module, executor, None, {})
        return executor

    @override
    def on_train_start(self) -> None:
        """Start measuring this fit's optimizer steps (rank 0, which logs them)."""
        self.step_timer = StepTimer(self.root_device) if self.global_rank == 0 else None

    @override
    def on_train_end(self) -> None:
        """Leave the trained weights in the LightningModule the user holds; log the measured step (rank 0)."""
        self._refresh_module()
        measured = self.step_timer.median_seconds() if self.step_timer is not None else None
        if measured is not None and self.lightning_module is not None:
            log_measured_step(self.lightning_module.loggers, measured, self.predicted_step, self.lightning_module.trainer.global_step)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Nothing: ``save_checkpoint`` writes each rank's own pieces (``strategy.checkpoint``), so no
        rank assembles the whole model to save it."""
        return {}

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The param groups a single-device optimizer over the whole module would save; the state itself
        is written by ``save_checkpoint``, each rank its pieces'."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        assert self.lightning_module is not None
        return single_device_param_groups(optimizer, self._optimizer_group_keys(optimizer))

    def _optimizer_group_keys(self, optimizer: Optimizer) -> list[list[str]]:
        """Per param group, the state_dict keys of its full parameters."""
        assert self.lightning_module is not None
        if self.executor is not None:
            return self._group_keys[self.optimizers.index(optimizer)]
        return group_keys_of(optimizer, self.lightning_module)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Write a sharded checkpoint directory at ``filepath``: every rank its pieces, atomically (all ranks call it).

        See ``lightning_nnscaler.checkpoint`` for the format; ``lightning-nnscaler ckpt merge`` makes a
        plain single-file checkpoint of it.
        """
        if storage_options is not None:
            raise TypeError(f"NnScalerStrategy.save_checkpoint does not take storage_options (got {storage_options!r})")
        every_rank_is_saving(filepath)  # before any collective: a save called on rank 0 only is refused by name
        module = self.lightning_module
        assert module is not None
        optimizers = [optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer for optimizer in self.optimizers]
        save_sharded(
            checkpoint, filepath, rank=self.global_rank, world_size=self.world_size, module=module,
            model_pieces=held_model_pieces(self.executor),
            optimizer_pieces=[held_optimizer_pieces(optimizer, self._locations if self.executor else {}, module) for optimizer in optimizers],
            group_keys=[self._optimizer_group_keys(optimizer) for optimizer in optimizers],
            plan={
                "recipe": self.recipe, "recipe_params": self.recipe_params,
                "plan_hash": self.plan.plan_hash if self.plan is not None and self.executor is not None else None,
            },
            gather=self._all_gather_objects,
            materialize=lambda key, tensor: self._materialize_piece(PieceLocation(key, full_box(tensor.shape)), tensor),
        )

    def full_state_dict(self, rank: int = 0) -> dict[str, Tensor]:
        """The whole model's current state_dict on ``rank`` (an empty dict on the others), streamed one piece at a time:
        the other ranks never hold more than one piece beyond their own (a collective: every rank calls it)."""
        module = self.lightning_module
        assert module is not None
        held = held_pieces(self.executor) if self.executor is not None else []
        return gather_state(
            module, held, self.global_rank, rank, self._all_gather_objects, self._broadcast_tensor,
            lambda key, tensor: self._materialize_piece(PieceLocation(key, full_box(tensor.shape)), tensor),
        )

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """The single-device checkpoint, assembled from a sharded directory (saved under any recipe and
        world size) or read from a plain file; always ``torch.load(weights_only=True)``. For a module built on
        meta a sharded directory is not assembled: Lightning gets its loops, callbacks and optimizer
        hyperparameters, and each rank reads only its own pieces' slices once the plan says which
        (``full_module.restore_pieces``)."""
        self._pretrained_pending = False  # the checkpoint's weights win over the pretrained ones
        if sharded_checkpoint.is_sharded_checkpoint(checkpoint_path):
            module = self.lightning_module
            if module is not None and has_meta_tensors(module):  # each rank reads its slices once planned
                self._pending_pieces = str(checkpoint_path)
                return {**sharded_checkpoint.read_pieces(checkpoint_path, []).common, "state_dict": {}}
            return sharded_checkpoint.load(checkpoint_path)
        return self.checkpoint_io.load_checkpoint(checkpoint_path, weights_only=True)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Load the full module; it is the truth now (an earlier fit's pieces are dropped). A module on meta takes the
        checkpoint's tensors as its own (tied weights stay tied)."""
        module = self.lightning_module
        assert module is not None
        if has_meta_tensors(module) and self._pending_pieces is not None:
            self.executor = None  # the next plan's pieces are read from the checkpoint, slice by slice
            self._evaluation_plans = {}
            return
        if has_meta_tensors(module):
            assign_state_dict(module, checkpoint["state_dict"], strict=strict)
        else:
            super().load_model_state_dict(checkpoint, strict=strict)
        self.executor = None
        self._evaluation_plans = {}
        self._module_is_stale = False

    # --- collectives -----------------------------------------------------------------------------

    @override
    def reduce(self, tensor: Union[Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Union[Tensor, Any]:
        """All-reduce ``tensor`` over ``group`` (the world by default); ``self.log(sync_dist=True)`` lands here."""
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        """Wait for every rank."""
        if _distributed_is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank."""
        if not _distributed_is_initialized():
            return obj
        container = [obj]
        dist.broadcast_object_list(container, src)
        return container[0]

    @override
    def on_exception(self, exception: BaseException) -> None:
        """A failing rank 0 takes down the ranks the script launcher started (Lightning's own watcher
        only reacts to a failing child), so none waits in a collective until its timeout."""
        if isinstance(self._launcher, _SubprocessScriptLauncher):
            self._launcher.kill(signal.SIGKILL)

    @override
    def teardown(self) -> None:
        """Undo the clipping hook and ``sync_batchnorm``'s conversion; the executor stays (see below)."""
        # The executor stays until the next fit: `trainer.save_checkpoint` after `fit` still needs its pieces.
        vars(self.precision_plugin).pop("clip_grad_by_norm", None)
        module = self.lightning_module
        if module is not None and module._trainer is not None and module._trainer.state.fn == TrainerFn.FITTING and self._layer_sync:
            self.model = self._layer_sync.revert(self.model)  # as DDPStrategy; the layers keep their tensors
        if module is not None and has_meta_tensors(module):  # Lightning's teardown moves the module to the CPU: not from meta
            module._apply(lambda tensor: tensor if tensor.is_meta else tensor.cpu())
            _optimizers_to_device(self.optimizers, torch.device("cpu"))
            for part in (self.precision_plugin, self.accelerator, self.checkpoint_io, self.cluster_environment):
                if part is not None:
                    part.teardown()
            return
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``"nnscaler"`` (dp), ``"nnscaler_spawn"`` (dp, spawn launcher) and ``"nnscaler_<recipe>"`` per
        catalog recipe, including those registered later with ``lightning_nnscaler.register_recipe``."""
        strategy_registry.register(
            "nnscaler", cls, description="nnScaler strategy with the default recipe (dp)", override=True, recipe="dp"
        )
        strategy_registry.register(
            "nnscaler_spawn", cls, description="nnScaler strategy (dp) with start_method 'spawn'", override=True,
            recipe="dp", start_method="spawn",
        )
        on_register(lambda spec: strategy_registry.register(
            f"nnscaler_{spec.name}", cls, description=f"nnScaler strategy, recipe {spec.name}: {spec.summary}",
            override=True, recipe=spec.name,
        ))  # catalog recipes now, recipes registered with `register_recipe` later


def random_stream(step: int, draw: int) -> RandomStream:
    """The stream of a training batch's random ops: ``seed_everything``'s seed (``PL_GLOBAL_SEED``, 0
    without one), the optimizer step and the batch's index in its accumulation window, so a run
    resumed from a checkpoint (same ``global_step``) draws what the uninterrupted run would have."""
    return RandomStream(seed=int(os.environ.get("PL_GLOBAL_SEED", 0)), step=step, draw=draw)
