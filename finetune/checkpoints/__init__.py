"""Checkpoints on disk, without torch: the launching process reads them before it starts anything.

marker.py     the commit marker that makes a checkpoint count (written by the ranks, read by both)
fields.py     the recipe fields a marker records, and which changes a resume may carry
resume.py     which checkpoints count, which one a run resumes from, whether resuming is safe
retention.py  which checkpoints stay on disk
"""
