# Shared storage for length-predictor artifacts: the retrain command (a one-off task of the
# trainer image) writes a new version here and registers its path; every gateway task loads it
# from the same path when the registry marks it active (gateway/prediction/lifecycle.py).

resource "aws_efs_file_system" "predictor" {
  region           = var.region
  encrypted        = true
  kms_key_id       = var.kms_key_arn
  performance_mode = "generalPurpose"
  throughput_mode  = "elastic"
  tags             = merge(var.tags, { Name = "${local.name}-predictor" })
}

resource "aws_efs_backup_policy" "predictor" {
  region         = var.region
  file_system_id = aws_efs_file_system.predictor.id
  backup_policy {
    status = "ENABLED"
  }
}

resource "aws_efs_mount_target" "predictor" {
  count           = length(var.private_subnet_ids)
  region          = var.region
  file_system_id  = aws_efs_file_system.predictor.id
  subnet_id       = var.private_subnet_ids[count.index]
  security_groups = [aws_security_group.predictor_store.id]
}

# Tasks see only /predictor, as the container's user, whatever they ask for.
resource "aws_efs_access_point" "predictor" {
  region         = var.region
  file_system_id = aws_efs_file_system.predictor.id
  posix_user {
    uid = local.container_uid
    gid = local.container_uid
  }
  root_directory {
    path = "/predictor"
    creation_info {
      owner_uid   = local.container_uid
      owner_gid   = local.container_uid
      permissions = "750"
    }
  }
  tags = var.tags
}

data "aws_iam_policy_document" "predictor_store" {
  statement {
    sid     = "OnlyEncryptedTransport"
    effect  = "Deny"
    actions = ["*"]
    principals {
      type        = "AWS"
      identifiers = ["*"]
    }
    resources = [aws_efs_file_system.predictor.arn]
    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }
  statement {
    sid     = "GatewayTasksThroughTheAccessPoint"
    actions = ["elasticfilesystem:ClientMount", "elasticfilesystem:ClientWrite"]
    principals {
      type        = "AWS"
      identifiers = [aws_iam_role.task.arn]
    }
    resources = [aws_efs_file_system.predictor.arn]
    condition {
      test     = "StringEquals"
      variable = "elasticfilesystem:AccessPointArn"
      values   = [aws_efs_access_point.predictor.arn]
    }
  }
}

resource "aws_efs_file_system_policy" "predictor" {
  region         = var.region
  file_system_id = aws_efs_file_system.predictor.id
  policy         = data.aws_iam_policy_document.predictor_store.json
}
