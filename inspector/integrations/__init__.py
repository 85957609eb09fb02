"""One-line integrations with training frameworks (optional extras).

    from inspector.integrations.lightning import GradientInspectorCallback      # pip install 'gradient-inspector[lightning]'
    trainer = lightning.pytorch.Trainer(callbacks=[GradientInspectorCallback(serve=True)])

    from inspector.integrations.huggingface import GradientInspectorCallback    # pip install 'gradient-inspector[hf]'
    trainer = transformers.Trainer(..., callbacks=[GradientInspectorCallback(serve=True)])

Each submodule imports its framework; this package imports neither, and ``import inspector``
does not import this package. See docs/integrations.md.
"""

__all__: list[str] = []
