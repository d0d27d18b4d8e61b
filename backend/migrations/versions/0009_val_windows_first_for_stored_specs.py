"""stored specs keep the validation windows they ran with: data.val_windows = "first"

`data.val_windows` (training.config) says where a run's validation windows lie in the validation split. Before it
existed every run validated on the *first* val_batches x batch_size windows in a row (for a folder of books: the
first book's held-out tail, perhaps the second's); its default is now "spread" (evenly over the split). A stored spec
without the key would be read with the new default when it is dispatched again (a queued run, the reconciler's
re-send, a resume after a lost worker), and its val loss - the verdict's measure - would change meaning mid-run or
between the recipes of one experiment. This migration writes the definition those specs ran with into them: every
training run's `spec.data` that lacks the key gets "first", and so does the `data_config` of an experiment whose
runs now say "first" (what the dashboard shows; an experiment whose runs say "spread" keeps the user's words). External
runs (recorded, no spec of ours) are left as they are.

Downgrade takes the key out where it is "first" (the code before it did exactly that). A run created after the
upgrade with "spread" keeps its key: the code before this revision refuses such a spec (unknown key
data.val_windows) rather than validating it on other windows than it ran with.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-30 03:30:00
"""
from backend.migrations.stored_specs import drop_legacy_value, write_legacy_value


revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None

KEY, LEGACY = "val_windows", "first"


def upgrade() -> None:
    write_legacy_value(KEY, LEGACY)


def downgrade() -> None:
    drop_legacy_value(KEY, LEGACY)
