from diffexp.model.decoder import Decoder

__all__ = ["Decoder"]
