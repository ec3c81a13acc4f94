"""A model configured with ``vocab_size: null`` takes the data module's vocabulary size."""
from __future__ import annotations

from typing import Any


def fill_vocab_size(config: Any) -> None:
    """Set ``model.init_args.vocab_size`` from the data module (built here once to ask it) when the
    config leaves it null; a model without that argument is left alone (an argument link would add
    the key to every model)."""
    model, data = config.get("model"), config.get("data")
    init = getattr(model, "init_args", None)
    if data is None or init is None or "vocab_size" not in init or init["vocab_size"] is not None:
        return
    import lightning.pytorch as pl
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(pl.LightningDataModule, "data")
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # jsonargparse >= 4.49: instantiate
    built = instantiate(parser.parse_object({"data": data.clone().as_dict()})).data
    vocab = getattr(built, "vocab_size", None)
    if vocab is not None:
        init["vocab_size"] = int(vocab)
