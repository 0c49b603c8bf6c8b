"""Building blocks of the model: norm, rotary embedding, activation, linear, and the attention layer."""
