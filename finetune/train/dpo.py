"""DPOTrainer that accepts our cached, already tokenized preference data.

DPOTrainer (trl 1.16) always runs its own `_prepare_dataset`, which looks for text `prompt`
columns; SFTTrainer instead skips tokenization when `input_ids` is present. This subclass
gives DPO the same behaviour for datasets that already carry `prompt_ids` / `chosen_ids` /
`rejected_ids` (built by finetune/train/tokenize.py exactly as DPOTrainer's tokenize_fn
does), so a cache hit really skips tokenization. It is an override of a documented
extension point of our own subclass, not a patch of TRL.
"""

from __future__ import annotations

from trl import DPOTrainer

TOKENIZED = ("prompt_ids", "chosen_ids", "rejected_ids")


class PretokenizedDPOTrainer(DPOTrainer):
    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        if all(c in (dataset.column_names or []) for c in TOKENIZED):
            return dataset
        return super()._prepare_dataset(dataset, processing_class, args, dataset_name)
