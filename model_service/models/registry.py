"""Architectures -> the module class that runs them.

`ModelConfig.family` names the architecture (from `config.json`'s `architectures` or a GGUF
file's metadata); a new architecture is one entry here plus its module. Every class registered
takes a `ModelConfig` and is called as `module(input_ids, positions, ctx)`.
"""

from __future__ import annotations

from torch import nn

from model_service.errors import ModelLoadError
from model_service.models.config import ModelConfig
from model_service.models.deepseek import DeepseekModel
from model_service.models.gemma import GemmaModel
from model_service.models.gpt_oss import GptOssModel
from model_service.models.granite import GraniteModel
from model_service.models.llama import DecoderModel
from model_service.models.olmo2 import Olmo2Model
from model_service.models.phi3 import Phi3Model
from model_service.models.qwen3_next import Qwen3NextModel

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "llama": DecoderModel,
    "mistral": DecoderModel,
    "qwen2": DecoderModel,
    "qwen3": DecoderModel,
    "mixtral": DecoderModel,
    "qwen2_moe": DecoderModel,
    "qwen3_moe": DecoderModel,
    "qwen3_next": Qwen3NextModel,
    "deepseek_v2": DeepseekModel,
    "deepseek_v3": DeepseekModel,
    "granite": GraniteModel,
    "olmo2": Olmo2Model,
    "phi3": Phi3Model,
    "gemma2": GemmaModel,
    "gemma3_text": GemmaModel,
    "gpt_oss": GptOssModel,
}


def model_class(config: ModelConfig) -> type[nn.Module]:
    try:
        return MODEL_CLASSES[config.family]
    except KeyError:
        raise ModelLoadError(
            f"no model class for architecture family {config.family!r}; known: {sorted(MODEL_CLASSES)}"
        ) from None
