"""The recipes' LightningModules: image classifiers, BERT masked-LM, a Llama decoder LM, an LSTM language model."""
from mptrain.models.bert import BertMLM, build_bert_mlm
from mptrain.models.classifier import ImageClassifier
from mptrain.models.llama import LlamaLM, build_llama
from mptrain.models.lstm_lm import LSTMLanguageModel
from mptrain.models.vision import build_image_model, digits_cnn

__all__ = ["BertMLM", "ImageClassifier", "LSTMLanguageModel", "LlamaLM", "build_bert_mlm", "build_image_model",
           "build_llama", "digits_cnn"]
