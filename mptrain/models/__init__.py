"""The recipes' LightningModules: image classifiers, BERT masked-LM, an LSTM language model."""
from mptrain.models.bert import BertMLM, build_bert_mlm
from mptrain.models.classifier import ImageClassifier
from mptrain.models.lstm_lm import LSTMLanguageModel
from mptrain.models.vision import build_image_model, digits_cnn

__all__ = ["BertMLM", "ImageClassifier", "LSTMLanguageModel", "build_bert_mlm", "build_image_model", "digits_cnn"]
