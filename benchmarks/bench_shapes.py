"""The model shapes the benchmarks share, without torch (bench_model.py builds models from them before
any GPU library is imported; bench_workload.py configures trainer_bench's)."""

QWEN25 = {
    # config.json of the hub models Qwen2.5-0.5B / -1.5B / -7B (shapes only), randomly initialised.
    "qwen2-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                       num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                     num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
}
