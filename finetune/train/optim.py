"""LoRA+ (adapter.loraplus_lr_ratio): the trainer's optimizer built by peft's create_loraplus_optimizer.

The trainer class the recipe picked is subclassed (a public extension point: Trainer.create_optimizer)
so the optimizer is made where the Trainer makes its own, after FSDP/DeepSpeed have wrapped the model,
with the optimizer class and hyper-parameters the TrainingArguments name.
"""

from __future__ import annotations

from finetune.recipe.schema import Recipe


def with_optimizer(cls: type, recipe: Recipe) -> type:
    """`cls`, or a subclass of it whose optimizer is LoRA+ when the recipe asks for it."""
    ratio = recipe.adapter.loraplus_lr_ratio
    if not ratio:
        return cls

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            from peft.optimizers import create_loraplus_optimizer

            opt_cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, self.model if model is None else model)
            kwargs = dict(kwargs)
            lr = kwargs.pop("lr", self.args.learning_rate)
            self.optimizer = create_loraplus_optimizer(
                self.model if model is None else model,
                opt_cls,
                lr=lr,
                loraplus_lr_ratio=ratio,
                weight_decay=self.args.weight_decay,
                **kwargs,
            )
        return self.optimizer

    return type(f"LoraPlus{cls.__name__}", (cls,), {"create_optimizer": create_optimizer})
