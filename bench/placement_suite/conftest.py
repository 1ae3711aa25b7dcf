"""Keep the benchmark suite offline: the models are random and the tokenizer is local."""

import os

# Set before anything imports huggingface_hub, which reads these once at import; the xdist
# workers inherit them from the controller and set them again when they load this file.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
