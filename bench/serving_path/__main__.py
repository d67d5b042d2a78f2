from bench.serving_path.run import main

raise SystemExit(main())
