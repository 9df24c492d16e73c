"""The application layer, above the stages: the ``mammoth`` command (`mammoth_app.cli`), the local
pipeline runner (`local`, `up`, `background`, `supervise`), the HTTP tools (`client`, `bench`),
the in-process reference (`inprocess`) and the built-in checkpoint (`make_checkpoint`,
`check_checkpoint`). It may import every component; `mammoth_core` imports none of them."""
