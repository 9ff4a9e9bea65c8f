"""Cost model and discrete-event simulator over the per-rank action lists the runtime executes (DESIGN.md §1, §8).

- ``specs``: hardware specs in YAML (V100, A100, H100, H200 from datasheets; ``cpu`` measured here).
- ``costs``: op work (FLOPs, bytes), roofline time, α–β communication with ring conventions.
- ``profile``: measured op times, cached per device in the user cache directory.
- ``tasks`` / ``simulate``: per-rank task lists and their discrete-event simulation (``replay``: list
  scheduling for dedicated devices; ``events``: an event heap for ranks sharing CPU cores; ``results``).
- ``calibrate``: the microbenchmarks behind the measured ``cpu`` spec (``benchmarks/calibrate_comm.py``).
- ``from_plan`` / ``predict``: a Plan's task lists and its predicted step time and memory.
- ``meter``: the saved-for-backward peak metered while a program runs. What autograd saves per op
  (``ir.saved``, measured on ``meta``) and the activation bytes a rank keeps (``materialize.kept``)
  live below, since ``explain`` counts with them too.
- ``analytic``: dp × tp × pp transformer plans built from shapes alone (GPT-3 175B on 1024 GPUs);
  ``cluster`` simulates them and searches them, and ``symmetric`` simulates one representative rank
  per pipeline stage, its collectives priced for their whole groups.
"""

from lightning_nnscaler.sim.costs import CommModel, OpTime, Roofline, op_work
from lightning_nnscaler.sim.predict import DeviceModel, Prediction, predict
from lightning_nnscaler.sim.simulate import Machine, SimResult, simulate
from lightning_nnscaler.sim.specs import HardwareSpec, available_specs, load_spec, spec_for_device

__all__ = [
    "CommModel", "DeviceModel", "HardwareSpec", "Machine", "OpTime", "Prediction", "Roofline", "SimResult",
    "available_specs", "load_spec", "op_work", "predict", "simulate", "spec_for_device",
]
