"""Each method's settings in a module of its own, named as its strategy in :mod:`coordinator.strategies`
(the section of the same name in a coordinator configuration). They import nothing of the coordinator, so that
:mod:`coordinator.config` gathers them and the strategies read them."""
