# The gateway as an ECS Fargate service in the private subnets. One task: routing state (in-flight
# ledger, load reports) lives in its memory. A deployment starts the new task, waits until the
# load balancer finds it healthy, then drains the old one for var.drain_seconds.

data "aws_partition" "current" {}

resource "aws_cloudwatch_log_group" "gateway" {
  region            = var.region
  name              = "/fedllm/${var.name_prefix}/gateway"
  retention_in_days = var.log_retention_days
  kms_key_id        = var.kms_key_arn
  tags              = var.tags
}

resource "aws_ecs_cluster" "gateway" {
  region = var.region
  name   = local.name
  setting {
    name  = "containerInsights"
    value = "enabled"
  }
  tags = var.tags
}

data "aws_iam_policy_document" "assume_ecs_tasks" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["ecs-tasks.amazonaws.com"]
    }
  }
}

# Used by ECS itself: pull the image, write logs, read the two secrets into the environment.
resource "aws_iam_role" "execution" {
  name_prefix        = "${local.name}-exec-"
  assume_role_policy = data.aws_iam_policy_document.assume_ecs_tasks.json
  tags               = var.tags
}

resource "aws_iam_role_policy_attachment" "execution" {
  role       = aws_iam_role.execution.name
  policy_arn = "arn:${data.aws_partition.current.partition}:iam::aws:policy/service-role/AmazonECSTaskExecutionRolePolicy"
}

data "aws_iam_policy_document" "read_secrets" {
  statement {
    actions   = ["secretsmanager:GetSecretValue"]
    resources = [aws_secretsmanager_secret.gateway.arn, aws_secretsmanager_secret.database.arn]
  }
  statement {
    actions   = ["kms:Decrypt"]
    resources = [var.kms_key_arn]
  }
}

resource "aws_iam_role_policy" "read_secrets" {
  name   = "read-gateway-secrets"
  role   = aws_iam_role.execution.id
  policy = data.aws_iam_policy_document.read_secrets.json
}

# Used by the gateway process: only the predictor file system (its policy names this role).
resource "aws_iam_role" "task" {
  name_prefix        = "${local.name}-task-"
  assume_role_policy = data.aws_iam_policy_document.assume_ecs_tasks.json
  tags               = var.tags
}

locals {
  secret_environment = merge(
    {
      PGPASSWORD          = "${aws_secretsmanager_secret.database.arn}:password::"
      GATEWAY_ADMIN_TOKEN = "${aws_secretsmanager_secret.gateway.arn}:admin_token::"
      FEDLLM_TLS_CA_PEM   = "${aws_secretsmanager_secret.gateway.arn}:ca_pem::"
      FEDLLM_TLS_CERT_PEM = "${aws_secretsmanager_secret.gateway.arn}:cert_pem::"
      FEDLLM_TLS_KEY_PEM  = "${aws_secretsmanager_secret.gateway.arn}:key_pem::"
    },
    var.hf_token == null ? {} : { HF_TOKEN = "${aws_secretsmanager_secret.gateway.arn}:hf_token::" },
  )
  # What the serving gateway and a one-off retraining task share: storage and logs.
  container_base = {
    essential              = true
    readonlyRootFilesystem = true
    mountPoints = [
      { sourceVolume = "state", containerPath = "/var/lib/fedllm", readOnly = false },
      { sourceVolume = "tmp", containerPath = "/tmp", readOnly = false },
      { sourceVolume = "predictor", containerPath = local.predictor_mount, readOnly = false },
    ]
    stopTimeout = 120
    logConfiguration = {
      logDriver = "awslogs"
      options = {
        awslogs-group         = aws_cloudwatch_log_group.gateway.name
        awslogs-region        = var.region
        awslogs-stream-prefix = "gateway"
      }
    }
  }
  container = merge(local.container_base, {
    name  = "gateway"
    image = var.image
    # A new secret version (re-issued certificate, replaced password) changes the task definition,
    # so the service rolls its tasks onto it.
    environment = [
      for key, value in merge(local.environment, {
        FEDLLM_SECRET_VERSIONS = "${aws_secretsmanager_secret_version.gateway.version_id},${aws_secretsmanager_secret_version.database.version_id}"
      }) : { name = key, value = value }
    ]
    secrets      = [for key, value in local.secret_environment : { name = key, valueFrom = value }]
    portMappings = [{ containerPort = local.container_port, protocol = "tcp" }]
    # The image's HEALTHCHECK, repeated because ECS does not use the image's own.
    healthCheck = {
      command     = ["CMD", "python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('GATEWAY_PORT', '8000') + '/healthz', timeout=5)"]
      interval    = 30
      timeout     = 10
      retries     = 3
      startPeriod = 300
    }
  })
  # The trainer image (docker build --target trainer: torch and the training extras, which the
  # gateway image leaves out) with what retraining reads: the database, and the Hugging Face token
  # for copying an artifact in. Not the admin token, the sites' TLS key or the federation.
  retrain_container = merge(local.container_base, {
    name        = "retrain"
    image       = var.trainer_image
    environment = [{ name = "GATEWAY_DATABASE_URL", value = local.database_url }]
    secrets = [
      for key, value in local.secret_environment : { name = key, valueFrom = value }
      if contains(["PGPASSWORD", "HF_TOKEN"], key)
    ]
  })
  # `python -m gateway.retrain_predictor` into a new directory of the predictor file system (see
  # the retrain_command output); VERSION is the operator's to replace.
  retrain_command = ["python", "-m", "gateway.retrain_predictor", "--out", "${local.predictor_mount}/VERSION", "--activate", "if-better"]
  volumes         = ["state", "tmp"]
}

resource "aws_ecs_task_definition" "gateway" {
  region                   = var.region
  family                   = local.name
  requires_compatibilities = ["FARGATE"]
  network_mode             = "awsvpc"
  cpu                      = tostring(var.cpu)
  memory                   = tostring(var.memory)
  execution_role_arn       = aws_iam_role.execution.arn
  task_role_arn            = aws_iam_role.task.arn
  container_definitions    = jsonencode([local.container])
  runtime_platform {
    operating_system_family = "LINUX"
    cpu_architecture        = "X86_64"
  }
  # Task storage: the rendered federation file and the tokenizers (docker/gateway-entrypoint.sh).
  dynamic "volume" {
    for_each = local.volumes
    content {
      name = volume.value
    }
  }
  volume {
    name = "predictor"
    efs_volume_configuration {
      file_system_id     = aws_efs_file_system.predictor.id
      transit_encryption = "ENABLED"
      authorization_config {
        access_point_id = aws_efs_access_point.predictor.id
        iam             = "ENABLED"
      }
    }
  }
  tags = var.tags
}

# `python -m gateway.retrain_predictor` as a one-off task (see the retrain_command output): the
# trainer image with the gateway's database and predictor storage, no port and no health check.
resource "aws_ecs_task_definition" "retrain" {
  region                   = var.region
  family                   = "${local.name}-retrain"
  requires_compatibilities = ["FARGATE"]
  network_mode             = "awsvpc"
  cpu                      = tostring(var.cpu)
  memory                   = tostring(var.memory)
  execution_role_arn       = aws_iam_role.execution.arn
  task_role_arn            = aws_iam_role.task.arn
  container_definitions    = jsonencode([local.retrain_container])
  runtime_platform {
    operating_system_family = "LINUX"
    cpu_architecture        = "X86_64"
  }
  dynamic "volume" {
    for_each = local.volumes
    content {
      name = volume.value
    }
  }
  volume {
    name = "predictor"
    efs_volume_configuration {
      file_system_id     = aws_efs_file_system.predictor.id
      transit_encryption = "ENABLED"
      authorization_config {
        access_point_id = aws_efs_access_point.predictor.id
        iam             = "ENABLED"
      }
    }
  }
  tags = var.tags
}

resource "aws_ecs_service" "gateway" {
  region                             = var.region
  name                               = local.name
  cluster                            = aws_ecs_cluster.gateway.id
  task_definition                    = aws_ecs_task_definition.gateway.arn
  desired_count                      = 1
  launch_type                        = "FARGATE"
  platform_version                   = "LATEST"
  deployment_minimum_healthy_percent = 100
  deployment_maximum_percent         = 200
  health_check_grace_period_seconds  = 300
  propagate_tags                     = "SERVICE"
  # apply returns once the new task serves and the old one is gone: the next step of a change
  # (e.g. destroying a removed site) never races the gateway that still routes to it.
  wait_for_steady_state = true
  deployment_circuit_breaker {
    enable   = true
    rollback = true
  }
  network_configuration {
    subnets          = var.private_subnet_ids
    security_groups  = [aws_security_group.tasks.id]
    assign_public_ip = false
  }
  load_balancer {
    target_group_arn = aws_lb_target_group.gateway.arn
    container_name   = local.container.name
    container_port   = local.container_port
  }
  depends_on = [aws_lb_listener.https, aws_efs_mount_target.predictor]
  tags       = var.tags
}
