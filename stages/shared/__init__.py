"""What the pipeline's stages share: params (``params``), artifact paths and atomic writes (``artifacts``), processes,
progress and errors (``runtime``), checkpoints and resume (``resume``), model loading (``models``), the scorer
(``scoring``), the float kernels (``numerics``), the synthetic corpus (``synthetic``), dvc.yaml as data
(``pipeline``) and the CLI (``cli``). Nothing here imports a stage module (tests/test_layers.py holds it to that);
importing the package imports none of its modules, so that ``stages.__main__`` can set the float kernels first.
"""
