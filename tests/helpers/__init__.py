"""Small programs the tests launch (through the real launcher) in place of finetune.train."""
