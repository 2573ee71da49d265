"""What a `--speculative-config` loads and builds: the proposer's own model (a draft model, the
checkpoint's MTP layer, an EAGLE-3 head), read before the target's executor is built (its K/V
shares the executor's memory budget, and EAGLE-3 decides which of the target's layers the
executor keeps), then the proposer and `Speculation` over it.
"""

from __future__ import annotations

from dataclasses import dataclass

from model_service.engine.config import EngineConfig
from model_service.engine.draft import DraftProposer, load_draft
from model_service.engine.eagle3 import Eagle3Proposer
from model_service.engine.mtp import MtpProposer
from model_service.engine.speculation import NgramProposer, Proposer, Speculation, SpeculativeConfig
from model_service.models.config import ModelConfig
from model_service.models.eagle3 import Eagle3Config, Eagle3Draft, load_eagle3
from model_service.models.loader import LoadedModel
from model_service.models.mtp import MtpLayer, load_mtp_layer


@dataclass
class ProposerModels:
    """At most one of `draft`, `mtp`, `eagle` (none for n-gram); `kv_config`: the config of the
    model whose K/V the executor budgets beside the target's; `aux_layers`: the target layers
    whose input states the executor keeps (EAGLE-3)."""

    draft: LoadedModel | None = None
    mtp: MtpLayer | None = None
    eagle: tuple[Eagle3Draft, Eagle3Config] | None = None
    kv_config: ModelConfig | None = None
    aux_layers: tuple[int, ...] = ()


def load_proposer_models(
    spec: SpeculativeConfig | None, config: EngineConfig, target: LoadedModel
) -> ProposerModels:
    """The model a speculative config asks for, loaded and checked against the target."""
    draft = load_draft(spec, config, target)  # None unless method "draft"
    if draft is not None:
        return ProposerModels(draft=draft, kv_config=draft.config)
    if spec is not None and spec.is_mtp:
        return ProposerModels(mtp=load_mtp_layer(target), kv_config=target.config.mtp_layer_config())
    if spec is not None and spec.is_eagle3:
        assert spec.model is not None
        head, cfg = load_eagle3(spec.model, target)
        return ProposerModels(eagle=(head, cfg), kv_config=cfg.layer, aux_layers=cfg.aux_layers)
    return ProposerModels()


def build_speculation(
    spec: SpeculativeConfig | None,
    models: ProposerModels,
    target: LoadedModel,
    config: EngineConfig,
    num_blocks: int,
    max_model_len: int,
) -> Speculation | None:
    """Speculative decoding as configured (a proposer model's cache has as many blocks as the
    target's, budgeted by the executor); None when off."""
    if spec is None:
        return None
    vocab_size = target.config.vocab_size
    proposer: Proposer
    if models.draft is not None:
        proposer = DraftProposer(models.draft, config, num_blocks, max_model_len, vocab_size)
    elif models.mtp is not None:
        proposer = MtpProposer(models.mtp, target, config, num_blocks, max_model_len)
    elif models.eagle is not None:
        eagle = Eagle3Proposer(*models.eagle, target, config, num_blocks, max_model_len)
        return Speculation(spec, eagle, max_model_len, vocab_size, fuse=eagle.fuse)
    else:
        proposer = NgramProposer(spec)
    return Speculation(spec, proposer, max_model_len, vocab_size)
