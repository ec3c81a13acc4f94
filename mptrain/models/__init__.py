"""Model builders and their LightningModules: a small CNN and torchvision ResNets
(``ImageClassifier``), transformers' BERT masked-LM (``BertMLM``), an LSTM language model
(``LSTMLanguageModel``).  torchvision / transformers are imported when a model needs them."""
from mptrain.models.bert import BertMLM, build_bert_mlm
from mptrain.models.classifier import ImageClassifier
from mptrain.models.lstm_lm import LSTMLanguageModel
from mptrain.models.vision import build_image_model, digits_cnn

__all__ = ["BertMLM", "ImageClassifier", "LSTMLanguageModel", "build_bert_mlm", "build_image_model", "digits_cnn"]
