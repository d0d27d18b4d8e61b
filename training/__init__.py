"""Precision Lab's training library (no web, database or worker imports).

Entry points other code calls:
  training.config.RunSpec.from_dict(d) / .to_dict(), SpecError      – the run spec
  python -m training SPEC.json --output-dir DIR                      – train one spec (also under torchrun)
  training.launch.run(spec, sink, output_dir=..., should_stop=...)   – what that command runs, with your sink
  training.train.train(spec, sink, should_stop=..., output_dir=..., resume=True) -> TrainResult
  training.sink.MetricSink / NullSink / ListSink / JsonlSink        – where metrics go
  training.model, training.tokenizer, training.data, training.checkpoint, training.flops
The loop's pieces: training.setup (the run), training.metrics_drain, training.checkpoint.Checkpointer,
training.validation. Submodules are imported on use, so `import training` stays cheap.
"""

from training import quiet as _quiet

_quiet.install()
