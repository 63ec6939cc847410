"""stronghold: train transformers larger than GPU memory on one GPU, as a DeepSpeed engine.

    engine, optimizer, _, lr_scheduler = stronghold.initialize(model=model, config="ds.json")

`initialize` takes the arguments of `deepspeed.initialize` and returns the same tuple; the engine is
a `StrongholdEngine` (a `DeepSpeedEngine`) configured by the `"stronghold"` section of ds.json.
It runs under DeepSpeed's launcher, torchrun or mpirun, and in a plain `python script.py`: with no
launcher's variables it sets up one process as DeepSpeed's launcher would (a free port; DeepSpeed's CPU
accelerator where there is no GPU).

Plain `deepspeed.initialize` on the same config ignores the `"stronghold"` section (DeepSpeed
skips unknown top-level keys) and builds an ordinary DeepSpeedEngine, which moves the whole model to
the GPU: call `stronghold.initialize` instead.

Heavy imports (DeepSpeed, Triton) happen on first use, so `import stronghold` is cheap.

Messages go through the `stronghold` logger (its modules' loggers are children of it): the start-up
placement table and other facts at INFO, problems at WARNING. While the application has configured no
logging (the root logger has no handler), a handler of the package's own prints them to stderr at INFO,
as DeepSpeed does for its logger; once the application configures logging, its handlers get the records
instead and that handler stays silent. `logging.getLogger("stronghold").setLevel(logging.WARNING)`
keeps the warnings only.
"""
from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any, Optional, Sequence

__version__ = "0.1.0"
__all__ = ["initialize", "StrongholdEngine", "StrongholdConfig", "__version__"]
"""The public API; everything under the subpackages is internal and may change between releases."""

if TYPE_CHECKING:
    from torch import nn


class _Format(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        level = "" if record.levelno <= logging.INFO else f"{record.levelname.lower()}: "
        return f"stronghold: {level}{super().format(record)}"


class _DefaultHandler(logging.StreamHandler):
    """stderr while the root logger has no handler: then Python would print nothing below WARNING and
    the package's INFO messages (the placement table) would be lost; with one, propagation reaches it
    and this handler stays silent, so nothing prints twice."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return
        self.setStream(sys.stderr)  # the current one (pytest and others replace sys.stderr)
        super().emit(record)


def _install_default_handler() -> None:
    package = logging.getLogger(__name__)
    if any(isinstance(handler, _DefaultHandler) for handler in package.handlers):
        return
    if package.level == logging.NOTSET:
        package.setLevel(logging.INFO)
    handler = _DefaultHandler()
    handler.setFormatter(_Format("%(message)s"))
    package.addHandler(handler)


_install_default_handler()


def initialize(args: Any = None, model: "Optional[nn.Module]" = None, optimizer=None, model_parameters=None,
               training_data=None, lr_scheduler=None, distributed_port: int = 29500, mpu=None,
               dist_init_required: Optional[bool] = None, collate_fn=None, config=None, config_params=None,
               *, blocks: "Optional[Sequence[nn.Module]]" = None):
    """`deepspeed.initialize` with a StrongholdEngine. `blocks=` names the transformer blocks of a model
    that discovery does not know. Returns (engine, optimizer, training_dataloader, lr_scheduler).

    Called with only a model (`stronghold.initialize(model)`, the HuggingFace Trainer one-liner), it
    prepares the model so that a Trainer built afterwards trains through the stronghold engine
    (stronghold/integrations/hf.py); the keyword arguments `config=` and `blocks=` are passed on."""
    from torch import nn

    from stronghold.engine.launch import default_accelerator
    default_accelerator()  # before DeepSpeed's first import, which reads it

    if isinstance(args, nn.Module) and model is None:
        from stronghold.integrations.hf import prepare
        return prepare(args, config=config, blocks=blocks)
    from stronghold.engine.launch import initialize_engine

    return initialize_engine(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                             training_data=training_data, lr_scheduler=lr_scheduler,
                             distributed_port=distributed_port, mpu=mpu, dist_init_required=dist_init_required,
                             collate_fn=collate_fn, config=config, config_params=config_params, blocks=blocks)


def __getattr__(name: str):
    if name == "StrongholdEngine":
        from stronghold.engine.engine import StrongholdEngine
        return StrongholdEngine
    if name == "StrongholdConfig":
        from stronghold.config import StrongholdConfig
        return StrongholdConfig
    raise AttributeError(f"module 'stronghold' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
