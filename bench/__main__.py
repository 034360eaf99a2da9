from bench.runner import main

raise SystemExit(main())
