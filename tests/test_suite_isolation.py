"""The suite must not write into the checkout: messages that tests send through the environment's embedded broker
once outlived them in ./plab-data/broker, and a later `plab demo` in the same checkout consumed them."""
from pathlib import Path

from plab.broker import make_app
from plab.settings import get_settings

REPO = Path(__file__).resolve().parent.parent


def test_the_environments_plab_home_and_broker_lie_outside_the_checkout():
    home = get_settings().home.resolve()
    assert home != REPO and REPO not in home.parents
    make_app()  # the embedded broker's folders, created where the settings say
    assert REPO not in get_settings().broker_folder.resolve().parents
