"""O1: the process-wide patches of torch functions by cast lists (`patch`), their cast rules
(`casters`), the wrappers that apply them (`wrappers`), `disable_casts()` regions (`regions`),
what a session does to torch's compiler (`compiler`) and the cast lists as data (`lists`)."""
