"""Precision Lab's training library (no web, database or worker imports).

Entry points other code calls:
  training.config.RunSpec.from_dict(d) / .to_dict(), SpecError      – the run spec
  training.train.train(spec, sink, should_stop=..., output_dir=..., resume=True) -> TrainResult
  training.sink.MetricSink / NullSink / ListSink / JsonlSink        – where metrics go
  python -m training.distributed SPEC.json --output-dir DIR          – the torchrun entry (gpus > 1)
  training.model, training.tokenizer, training.data, training.checkpoint, training.flops
Submodules are imported on use, so `import training` stays cheap.
"""
