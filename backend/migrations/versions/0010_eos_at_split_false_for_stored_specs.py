"""stored specs keep the tokens they ran with: data.eos_at_split = false

`data.eos_at_split` (training.config, training.shards) says whether a text file whose last val_fraction is held out
ends its training part with EOS. Before it existed the training part ran on into the next file's first token (for
a folder of books: the end of one book's training text, then the next book's first words, no separator); its
default is now true. A stored spec without the key would be read with the new default when it is dispatched again
(a queued run, the reconciler's re-send, a resume after a lost worker) and would train on other tokens mid-run or
between the recipes of one experiment. This migration writes the value those specs ran with into them: every
training run's `spec.data` without the key gets false, and so does the `data_config` of an experiment whose runs now
say false. External runs are left as they are. Downgrade takes the key out where it is false; a run created after
the upgrade with true keeps it (the code before this revision refuses such a spec: unknown key data.eos_at_split).
The helpers are 0009's (backend.migrations.stored_specs).

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-30 06:10:00
"""
from backend.migrations.stored_specs import drop_legacy_value, write_legacy_value


revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None

KEY, LEGACY = "eos_at_split", False


def upgrade() -> None:
    write_legacy_value(KEY, LEGACY)


def downgrade() -> None:
    drop_legacy_value(KEY, LEGACY)
