"""Values a run cannot work with are refused by name before launch."""

import pytest

from neox.config import ConfigError, load_dict


@pytest.mark.parametrize(
    "flat,message",
    [
        ({"eval_interval": 0}, "eval_interval=0"),
        ({"log_interval": 0}, "log_interval=0 must be >= 1"),
        ({"min_lr": -1e-5}, "min_lr=-1e-05 must be >= 0"),
        ({"lr": -0.1}, "lr=-0.1 must be >= 0"),
        ({"optimizer": {"type": "Adam", "params": {"lr": -1}}}, "optimizer.params.lr=-1"),
        ({"max_nonfinite_steps": -1}, "max_nonfinite_steps=-1 must be >= 0"),
        ({"use_checkpoint_lr_scheduler": True}, "use_checkpoint_lr_scheduler is not implemented"),
    ],
)
def test_refused(flat, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        load_dict(flat)
