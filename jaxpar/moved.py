"""Where the modules of the layout before the shared core's folders went: importing an old name says the new one.

Installed by jaxpar/__init__.py; an old `python -m` path or import fails with one line naming the module to use.
"""

from __future__ import annotations

import importlib.abc
import sys

MOVED = {
    "jaxpar.core.config_checks": "jaxpar.core.config.consistency",
    "jaxpar.core.contract": "jaxpar.core.config.contract",
    "jaxpar.core.mesh_spec": "jaxpar.core.config.mesh_spec",
    "jaxpar.core.tokens": "jaxpar.core.data.tokens",
    "jaxpar.core.corpus": "jaxpar.core.data.corpus",
    "jaxpar.core.bpe": "jaxpar.core.data.bpe",
    "jaxpar.core.data_order": "jaxpar.core.data.order",
    "jaxpar.core.shuffle": "jaxpar.core.data.shuffle",
    "jaxpar.core.packing": "jaxpar.core.data.packing",
    "jaxpar.core.buckets": "jaxpar.core.data.buckets",
    "jaxpar.core.batch_shapes": "jaxpar.core.data.batch_shapes",
    "jaxpar.core.prefetch": "jaxpar.core.data.prefetch",
    "jaxpar.core.rampup": "jaxpar.core.data.rampup",
    "jaxpar.core.hooks": "jaxpar.core.run.hooks",
    "jaxpar.core.run_lock": "jaxpar.core.run.lock",
    "jaxpar.core.resume": "jaxpar.core.run.resume",
    "jaxpar.core.recovery": "jaxpar.core.run.recovery",
    "jaxpar.core.peers": "jaxpar.core.run.peers",
    "jaxpar.core.stragglers": "jaxpar.core.run.stragglers",
    "jaxpar.core.metrics_log": "jaxpar.core.run.metrics",
    "jaxpar.core.trackers": "jaxpar.core.run.trackers",
    "jaxpar.core.run_dir": "jaxpar.core.run.directory",
    "jaxpar.core.run_summary": "jaxpar.core.run.summary",
    "jaxpar.core.stop_signals": "jaxpar.core.run.signals",
    "jaxpar.core.faults": "jaxpar.core.run.faults",
    "jaxpar.core.malloc": "jaxpar.core.run.malloc",
    "jaxpar.core.pipeline_schedules": "jaxpar.core.pipeline.schedules",
    "jaxpar.core.pipeline_choice": "jaxpar.core.pipeline.choice",
    "jaxpar.core.lr_schedule": "jaxpar.core.optimizer.lr_schedule",
    "jaxpar.core.muon": "jaxpar.core.optimizer.muon",
    "jaxpar.core.adamw8bit": "jaxpar.core.optimizer.adamw8bit",
    "jaxpar.core.flops": "jaxpar.core.model.flops",
    "jaxpar.core.experts": "jaxpar.core.model.experts",
    "jaxpar.core.block_sparsity": "jaxpar.core.model.layer_rules",
    "jaxpar.core.loss_chunks": "jaxpar.core.model.layer_rules",
    "jaxpar.core.sketches": "jaxpar.core.model.layer_rules",
    "jaxpar.core.state_file": "jaxpar.core.weights.state_file",
    "jaxpar.pipeline_auto": "jaxpar.pipeline.auto",
    "jaxpar.parallel.pipeline_executor": "jaxpar.pipeline.executor",
    "jaxpar.parallel.pipeline_plan": "jaxpar.pipeline.tick_plan",
    "jaxpar.parallel.gpipe": "jaxpar.pipeline.gpipe",
    "jaxpar.parallel.experts": "jaxpar.parallel.expert_parallel",
    "jaxpar.dispatch": "jaxpar.parallel.expert_dispatch",
    "jaxpar.hlo_collectives": "jaxpar.cost.hlo_collectives",
    "jaxpar.tools.jaxpr_flops": "jaxpar.cost.jaxpr_flops",
    "jaxpar.tools.plan_activations": "jaxpar.cost.activations",
    "jaxpar.tools.plan_optimizer": "jaxpar.cost.optimizer_traffic",
    "jaxpar.tools.plan_schedules": "jaxpar.cost.schedule_times",
    "jaxpar.tools.hf_gpt2": "jaxpar.formats.hf_gpt2",
    "jaxpar.tools.hf_llama": "jaxpar.formats.hf_llama",
    "jaxpar.tools.hf_mixtral": "jaxpar.formats.hf_mixtral",
    "jaxpar.tools.hf_deepseek_v3": "jaxpar.formats.hf_deepseek_v3",
    "jaxpar.tools.hf_tokenizer": "jaxpar.formats.hf_tokenizer",
    "jaxpar.tools.convert_state": "jaxpar.formats.train_state",
}


class MovedModules(importlib.abc.MetaPathFinder):
    """A finder that answers an old module name with an ImportError naming its new place."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED:
            raise ModuleNotFoundError(
                f"{fullname} moved to {MOVED[fullname]} (docs/architecture.md has the map)", name=fullname
            )
        return None


def install() -> None:
    """Put the finder first on sys.meta_path (once)."""
    if not any(isinstance(f, MovedModules) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedModules())
