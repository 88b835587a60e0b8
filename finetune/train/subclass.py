"""The trainer class a run uses: the TRL class of the recipe's method, subclassed (public extension
points only) with what finetune adds to every method: DataLoader workers that leave preemption to the
rank (finetune/train/signals.py), a full fine-tune's final weights saved in model.dtype (saved_dtype.py),
an adapter's final save under FSDP2 gathering the trained parameters alone (adapter_save.py), the step's
micro-batches kept for a non-finite step's record (callbacks.py), and LoRA+'s optimizer when the recipe asks for it
(optim.py)."""

from __future__ import annotations

from finetune.recipe.schema import Recipe, final_save_gathers_trained_only
from finetune.train.adapter_save import SavesTrainedParametersOnlyUnderFSDP
from finetune.train.callbacks import KeepsStepMicroBatches
from finetune.train.optim import with_optimizer
from finetune.train.saved_dtype import SavesFinalModelInItsDtype
from finetune.train.signals import WorkersLeavePreemptionToTheRank


def trainer_class(cls: type, recipe: Recipe, *own: type) -> type:
    """`cls` subclassed with finetune's mixins, and `own`: a method's own (first in the MRO)."""
    cls = with_optimizer(cls, recipe)
    mixins = (
        *own,
        KeepsStepMicroBatches,
        WorkersLeavePreemptionToTheRank,
        SavesFinalModelInItsDtype,
        SavesTrainedParametersOnlyUnderFSDP,
    )
    return type(cls.__name__, (*mixins, cls), {"gathers_trained_only": final_save_gathers_trained_only(recipe)})
