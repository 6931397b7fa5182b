from agentspec.verifier_server.cli import main

raise SystemExit(main())
