"""The code of the rank processes (`accelerate launch -m finetune.train RUN_DIR/recipe.resolved.yaml`).

Only the ranks import from here. What the launching process needs as well (reading and checking data,
checkpoint markers and resume checks) lives in the torch-free finetune/data and finetune/checkpoints,
which the ranks import; tests/unit/test_import_boundaries.py checks that nothing before launch imports this
package.
"""
