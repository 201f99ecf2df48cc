"""The ground floor: config, storage, manifests, locks, fingerprints, Ray session, tracking, console.

Every stage imports these; they import nothing from `stages/` or the roof (`workflow.pipeline`,
`workflow.__main__`, `workflow.report`). ARCHITECTURE.md explains the floors.
"""
